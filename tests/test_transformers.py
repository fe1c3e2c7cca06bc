"""Hugging Face Transformers 5 on tvmflash (``tvmflash.integrations.transformers``), through
``examples/hf_llama.py``'s checks on its random Llama, on the CPU: logits and greedy tokens against "sdpa",
a training step on packed sequences, left-padded batched generation and continuous batching, each through
the tvmflash function Transformers' flash path should call. Skipped where Transformers is not installed."""

import importlib.util
import inspect
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers import ContinuousBatchingConfig, DataCollatorWithFlattening  # noqa: E402
from transformers.integrations import hub_kernels  # noqa: E402
from transformers.modeling_flash_attention_utils import lazy_import_flash_attention  # noqa: E402

from tvmflash import flash_attn  # noqa: E402
from tvmflash.integrations import transformers as tvmflash_hf  # noqa: E402

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "hf_llama.py"
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("hf_llama", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tvmflash_hf.register()
    return module


@pytest.fixture
def model(example):
    return example.build_model("cpu").eval()


@pytest.fixture
def calls(monkeypatch):
    """How often each path of tvmflash's flash-attn functions runs: flash_attn_func's (``attention``),
    the varlen functions' (``varlen_attention``) and flash_attn_with_kvcache's (``decode_kernel_for``)."""
    counts = dict.fromkeys(("attention", "varlen_attention", "decode_kernel_for"), 0)
    for name in counts:
        def spy(*args, _original=getattr(flash_attn, name), _name=name, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)
        monkeypatch.setattr(flash_attn, name, spy)
    return counts


def test_register_serves_its_names_and_no_other(example):
    assert tvmflash_hf.register() == tvmflash_hf.NAME == "tvmflash_attention_2"  # again: harmless
    assert tvmflash_hf.register("tvmflash") == "tvmflash"  # the name the issue tried
    functions, _ = lazy_import_flash_attention("tvmflash")
    assert functions[:2] == (tvmflash_hf.flash_attn_func, tvmflash_hf.flash_attn_varlen_func)
    # Transformers 5.25 wraps it in torch.compiler.disable, 5.17 does not
    assert getattr(functions[2], "__wrapped__", functions[2]) is tvmflash_hf.flash_attn_with_kvcache
    assert hub_kernels.load_and_register_attn_kernel("not_a_hub_kernel") is None  # Transformers' answer
    for name in ("sdpa", "flash_attention_2", "kernels-community/flash-attn2", "paged|tvmflash", None):
        with pytest.raises(ValueError, match="name: expected a name containing 'flash'"):
            tvmflash_hf.register(name)


def test_logits_and_greedy_tokens_match_sdpa(example, model, calls):
    batch = example.padded(example.sequences([24, 24]), "cpu")
    ours, noise = example.compare_logits(model, batch["input_ids"])
    assert ours <= 4 * noise + 1e-6, (ours, noise)  # float32: within sdpa-vs-eager's rounding
    assert calls["attention"] and not calls["varlen_attention"]  # no padding: flash_attn_func
    expected = example.generate(model, "sdpa", batch, NEW_TOKENS)
    assert torch.equal(example.generate(model, tvmflash_hf.NAME, batch, NEW_TOKENS), expected)


def test_packed_training_step_matches_sdpa_on_the_padded_batch(example, model, calls):
    seqs = example.sequences([5, 11, 8], seed=2)
    step = example.packed_training_step(model, seqs)
    assert calls["varlen_attention"] and not calls["attention"]  # position_ids restarts -> cu_seqlens
    assert abs(step["loss"] - step["loss_sdpa"]) < 1e-5, step
    assert step["grad_diff"] < 1e-5 * step["grad_max"] + 1e-6, step
    assert step["after"] < step["loss"]
    # The collator's flash kwargs (cu_seq_lens_q/k, max_length_q/k) instead of position_ids: the same.
    model.train()
    with_kwargs = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": s} for s in seqs])
    loss, grads = example.gradients(model, tvmflash_hf.NAME, with_kwargs)
    loss_sdpa, grads_sdpa = example.gradients(model, "sdpa", example.padded(seqs, "cpu"))
    assert abs(loss - loss_sdpa) < 1e-5
    assert max((grads[n] - grads_sdpa[n]).abs().max().item() for n in grads) < 1e-5 * step["grad_max"] + 1e-6


def test_left_padded_batched_generation_and_continuous_batching(example, model, calls):
    prompts = example.sequences([5, 9, 3], seed=3)
    left = example.padded(prompts, "cpu", left=True)
    tokens = example.generate(model, tvmflash_hf.NAME, left, NEW_TOKENS)
    assert calls["varlen_attention"] and not calls["attention"]  # padding: unpadded rows, varlen
    assert torch.equal(tokens, example.generate(model, "sdpa", left, NEW_TOKENS))
    assert example.continuous_batching(model, prompts, NEW_TOKENS) == tokens.tolist()
    assert not calls["decode_kernel_for"]  # without CUDA Transformers keeps to varlen


def test_continuous_batching_decode_path_on_block_tables(example, model, calls, monkeypatch):
    """Transformers opens its decode fast path (flash_attn_with_kvcache over the paged cache's block table,
    -1 past each sequence's pages) to CUDA and XPU only: its check is told CUDA is there, so that the CPU
    runs the path."""
    from transformers.generation.continuous_batching import initialization

    class CudaSaysYes:
        cuda = types.SimpleNamespace(is_available=lambda: True)

        def __getattr__(self, name):
            return getattr(torch, name)

    prompts = example.sequences([5, 9, 3], seed=3)
    expected = example.generate(model, tvmflash_hf.NAME, example.padded(prompts, "cpu", left=True), NEW_TOKENS)
    monkeypatch.setattr(initialization, "torch", CudaSaysYes())
    # Transformers 5.17 would then batch asynchronously and capture CUDA graphs: asked not to
    wanted = {"use_async_batching": False, "use_cuda_graph": False}
    options = {k: v for k, v in wanted.items() if k in inspect.signature(ContinuousBatchingConfig).parameters}
    tokens = example.continuous_batching(model, prompts, NEW_TOKENS, **options)
    assert calls["decode_kernel_for"] >= (NEW_TOKENS - 1) * model.config.num_hidden_layers
    assert tokens == expected.tolist()


def test_attention_dropout_in_training_reaches_the_kernels(example, model, monkeypatch):
    """A model trained with attention dropout (Llama's ``attention_dropout``) passes it to flash_attn_func as
    flash-attn's dropout_p, which tvmflash serves: torch.manual_seed repeats a step bitwise, another draw
    differs, eval mode drops nothing (the logits of sdpa's eval), and the gradients are finite."""
    rates = []
    original = flash_attn.attention

    def spy(*args, dropout_p=0.0, **kwargs):
        rates.append(dropout_p)
        return original(*args, dropout_p=dropout_p, **kwargs)
    monkeypatch.setattr(flash_attn, "attention", spy)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    batch = example.padded(example.sequences([16, 16], seed=4), "cpu")
    model.train()
    torch.manual_seed(5)
    loss, grads = example.gradients(model, tvmflash_hf.NAME, batch)
    torch.manual_seed(5)
    again, _ = example.gradients(model, tvmflash_hf.NAME, batch)
    other, _ = example.gradients(model, tvmflash_hf.NAME, batch)
    assert rates and set(rates) == {0.1}
    assert loss == again and loss != other
    assert all(torch.isfinite(g).all() for g in grads.values())
    model.eval()
    ours, noise = example.compare_logits(model, batch["input_ids"])
    assert ours <= 4 * noise + 1e-6 and rates[-1] == 0.0
