import re, subprocess, sys
CUOBJ = "/tmp/tri/triton/backends/nvidia/bin/cuobjdump"
for cubin in sys.argv[1:]:
    sass = subprocess.run([CUOBJ, "-sass", cubin], capture_output=True, text=True).stdout
    seq = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if not m: continue
        ins = m.group(2)
        op = ins.split()[0] if not ins.startswith("@") else ins.split()[1]
        key = None
        if op.startswith("HGMMA"): key = "G" + op.split(".")[1] + ("s" if "gsb0" in ins else "")
        elif op.startswith("WARPGROUP.DEPBAR"): key = "W" + ins.split()[-1]
        elif op.startswith("WARPGROUP.ARRIVE"): key = "A"
        elif op.startswith("MUFU.EX2"): key = "e"
        elif op.startswith("SYNCS.ARRIVE"): key = "R"
        elif op.startswith("SYNCS.PHASECHK"): key = "F"
        elif op.startswith("BRA") or (ins.startswith("@") and "BRA" in op): key = "b"
        if key: seq.append(key)
    s = " ".join(seq)
    s = re.sub(r"(e )+", lambda m: f"e*{m.group(0).count('e')} ", s + " ")
    print(cubin, "\n ", s[:3000])
