"""CUDA-only behaviour: torch streams and CUDA graphs."""

import pytest
import torch
from conftest import random_qkv
from reference import check_attention

import tvmflash

pytestmark = pytest.mark.gpu


def test_runs_on_the_current_non_default_stream():
    q, k, v = random_qkv(2, 1024, 1024, 8, 8, 128, torch.bfloat16, "cuda")
    kernel = tvmflash.compile(head_dim=128, dtype="bfloat16")
    kernel(q, k, v)  # build and warm up outside the stream
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        # Long work queued first on the side stream: if the kernel ran on the default stream
        # it would read q before this write lands.
        stream_q = q.clone()
        for _ in range(20):
            stream_q.mul_(1.0)
        out, lse = kernel(stream_q, k, v, return_lse=True)
        done = torch.cuda.Event()
        done.record(stream)
    done.synchronize()
    check_attention(out, lse, q, k, v)


def test_cuda_graph_capture_and_replay():
    kernel = tvmflash.compile(head_dim=64, dtype="float16", causal=True)
    q, k, v = random_qkv(2, 300, 300, 4, 2, 64, torch.float16, "cuda")
    out = torch.empty_like(q)
    kernel(q, k, v, out=out)  # build before capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph):
            kernel(q, k, v, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(2):  # new inputs in the captured buffers, replay, check
        new_q, new_k, new_v = random_qkv(2, 300, 300, 4, 2, 64, torch.float16, "cuda")
        q.copy_(new_q), k.copy_(new_k), v.copy_(new_v)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _, lse = kernel(q, k, v, return_lse=True)
        check_attention(out, lse, q, k, v, causal=True)


def test_default_target_is_the_gpu():
    kernel = tvmflash.compile(head_dim=64, dtype="float16")
    major, minor = torch.cuda.get_device_capability()
    assert kernel.info()["target"].startswith("cuda sm_")
