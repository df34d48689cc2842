"""Write docs/benchmarks.md from the committed result tables in bench/results/.

    python bench/make_docs.py           # regenerate docs/benchmarks.md
    python bench/make_docs.py --check   # exit 1 when docs/benchmarks.md differs from what this writes

One section per bench/results/*.md file: its title (the file name, with the file's own first heading
where it starts with one), the GPU the file names, the bench/NOTES.md experiments that cite it, then
the file's text copied verbatim: its tables, the lines that say how they were measured and the
summary lines the bench script printed. Only two things change: the file's headings move two levels
down, under the section's, and a fenced block of raw output is replaced by a line pointing at the
file. The figures are never retyped: change a result file, then run this script.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
NOTES = ROOT / "bench" / "NOTES.md"
OUT = ROOT / "docs" / "benchmarks.md"

# The tables that describe the current code, first, in this order, with a title each; every other
# result file follows under "Experiment tables", in the order of the first experiment citing it.
CURRENT = {
    "fa_sweep_h200.md": "All attention families against torch SDPA (the FlashAttention sweep)",
    "decode_grid_h100.md": "Decode and key-value caches against torch SDPA, the whole grid, on an H100",
    "decode_grid_h200.md": "Decode and key-value caches against torch SDPA, the whole grid (before NOTES 71's combine)",
    "decode_h200.md": "Decode and key-value caches against torch SDPA, the quick grid",
    "decode_small_h100.md": "Decode at small shapes (B 1 and 8, Nk 1024 and 8192, Nq 1) against torch SDPA on an H100",
    "decode_chunk_packed_h200.md": "Chunked prefill through the key-value-cache API as packed sequences (the headline shapes) on an H200",
    "decode_chunk_dense_h200.md": "The same shapes with the chunk route of before (dense calls after a host read of the lengths), same H200",
    "decode_chunk_packed_graph_h200.md": "The headline shapes replayed in CUDA graphs, chunks as packed sequences, on an H200",
    "decode_chunk_dense_graph_h200.md": "The same graphed shapes with the chunk route of before (the decode family under capture), same H200",
    "varlen_fwd_kv_h200.md": "Packed sequences on fmha_sm90 after NOTES 116 (key counts on the GPU beside them) on an H200",
    "varlen_fwd_kv_before_h200.md": "The same packed sequences on the build before NOTES 116, same H200 run",
    "gqa_prefill_h200.md": "GQA prefill and chunked prefill against torch SDPA",
    "model_h100.md": "A GPT-style model's training step and generation, torch SDPA with and without gemmgen",
    "bwd_sweep_padded_h100.md": "The backward at head dims 80 and 96, run padded to 128, against torch SDPA's backward",
    "model_h200.md": "A GPT-style model's training step and generation, torch SDPA with and without gemmgen, on an H200",
    "bwd_sweep_h200.md": "The backward against torch SDPA's backward",
    "bwd_sweep_h100.md": "The backward against torch SDPA's backward on an H100",
    "bwd_fa2bwd_h100.md": "fa2_bwd_sm80 at head dims 160, 192 and 256 against torch SDPA's backward on an H100",
    "fa_sweep_hd_picks_h100.md": "Head dims 160 and 192 on the sm90 default set (the registry's picks) against torch SDPA on an H100",
    "fa_sweep_hd_h100.md": "Head dims 160 and 192: the 128x96 tiles with O stored from registers against torch SDPA on an H100",
    "fa_sweep_d256_h100.md": "Head dim 256: the cooperative and ping-pong 128x64 tiles against torch SDPA on an H100",
    "dropout_h100.md": "Dropout on Hopper (fmha_sm90 `_dropout`) against the call without dropout, mea_sm80 and torch SDPA's dropout on an H100",
    "dropout_bwd_h200.md": "The backward of dropout on Hopper (fmha_bwd_sm90 `_dropout`) against the backward without dropout and torch SDPA's on an H200",
    "dropout_bwd_mea_h200.md": "The backward of dropout on the previous path (mea_bwd_sm80 `_dropout`), same H200",
    "varlen_fwd_h100.md": "Packed sequences on fa2_sm80 (before fmha_sm90 ran them) against the same tokens dense and torch's varlen_attn on an H100",
    "varlen_bwd_h100.md": "The backward of packed sequences on fa2_bwd_sm80 (before fmha_bwd_sm90 ran them) against the same tokens dense and torch's varlen_attn on an H100",
    "varlen_bwd_fmha_bwd_sm90_launches_h100.md": "The backward of packed sequences on fmha_bwd_sm90 against the same tokens dense and torch's varlen_attn on an H100",
    "varlen_bwd_deterministic_h100.md": "The backward of packed sequences with deterministic=True (fmha_bwd_sm90) against the same tokens dense, deterministic too, and torch's varlen_attn on an H100",
    "varlen_bwd_deterministic_baseline_h100.md": "The same packed backward without deterministic=True, same H100 run",
    "varlen_bwd_deterministic_h200.md": "The backward of packed sequences with deterministic=True (fmha_bwd_sm90) on an H200",
    "varlen_bwd_deterministic_baseline_h200.md": "The same packed backward without deterministic=True, same H200 run",
    "bwd_deterministic_h100.md": "The backward with deterministic=True on an H100",
    "varlen_bwd_fmha_bwd_sm90_h100.md": "The backward of packed sequences on fmha_bwd_sm90 before NOTES 88's launches, on an H100",
    "varlen_fwd_fmha_sm90_h100.md": "Packed sequences on fmha_sm90 (the Hopper forward) against the same tokens dense and torch's varlen_attn on an H100",
    "bwd_deterministic_h200.md": "The backward with deterministic=True",
    "fp8_h100.md": "FP8 attention (e4m3 q, k, v, O in bf16) against bf16 and torch SDPA's bf16 backends on an H100",
    "fp8_accuracy_h100.md": "FP8 attention's error against the float64 reference of the dequantized inputs, on an H100",
    "bias_padding_h100.md": "Additive masks: a Hugging Face causal + padding mask against the unmasked call, mea_sm80 and torch SDPA on an H100",
    "bias_float_h100.md": "Additive masks: a float per-head bias against the unmasked call, mea_sm80 and torch SDPA on an H100",
    "bias_bwd_padding_h100.md": "Training steps with a Hugging Face causal + padding mask (fmha_bwd_sm90 `_bias`) against the unmasked step and torch SDPA on an H100",
    "bias_bwd_padding_mea_bwd_h100.md": "Training steps with a padding mask on the previous path (backward on mea_bwd_sm80), same H100 run",
    "bias_bwd_float_h100.md": "Training steps with a float per-head bias (fmha_bwd_sm90 `_bias`, every tile read) on an H100",
    "softcap_tanh_h100.md": "Softcap forward with the one-MUFU tanh (fmha_sm90 `_sc`) against the uncapped call on an H100",
    "softcap_bwd_tanh_h100.md": "Softcap backward with the one-MUFU tanh (fmha_bwd_sm90 `_sc`) against the uncapped backward on an H100",
    "bias_padding_kept_h100.md": "A padding-masked forward with the mask's kernel copy kept per mask version, against the unmasked call and SDPA on an H100",
    "bias_padding_each_call_h100.md": "The same calls converting the mask on every call (the previous code), same H100 run",
    "softcap_bwd_half_factors_h100.md": "Softcap backward with the 1 - tanh^2 factors in fp16 pairs (fmha_bwd_sm90 `_sc`) on an H100",
    "softcap_bwd_fp32_factors_h100.md": "The same calls on the previous tile (fp32 factors), same H100 run",
    "context_parallel_h200x2.md": "Context-parallel ring attention over two GPUs",
    "context_parallel_h200x4.md": "Context-parallel ring attention over four GPUs",
    "fa_short_h200.md": "Short sequences at d64 with the default build, untuned, against torch SDPA",
    "fa_sweep_default_h100.md": "The FlashAttention sweep on an H100 with fmha_sm90's default tiles, untuned",
    "fmha_pick_ab_kernels_h200.md": "The registry's pick against the fastest SDPA backend, kernels alone",
    "fmha_pick_ab_graph_h200.md": "The registry's pick against the fastest SDPA backend, CUDA graph replays",
    "fmha_pick_ab_eager_h200.md": "The registry's pick against the fastest SDPA backend, per call with the host path",
    "sm80_ab_fa2_h200.md": "fa2_sm80 against FlashAttention-2, alternating rounds",
    "sm80_fa_sweep_h200.md": "fa2_sm80 sweep: best instance, default pick and SDPA backends",
    "selection_value_h200.md": "Value of selection: heuristic and tuned picks against the fastest candidate",
    "overhead_h200.md": "Host overhead per call",
    "batched_gemm_default_h200.md": "Batched GEMM against cuBLAS as users get it: the default build, untuned, fp16",
    "batched_gemm_default_bf16_h200.md": "Batched GEMM against cuBLAS as users get it: the default build, untuned, bf16",
    "batched_gemm_default_h100.md": "Batched GEMM against cuBLAS as users get it on an H100, fp16",
    "batched_gemm_default_bf16_h100.md": "Batched GEMM against cuBLAS as users get it on an H100, bf16",
    "batched_gemm_issue_h100.md": "Batched GEMM on an H100: B*H = 256, M = N = 4096, K = 64 and the long-K shapes",
    "batched_gemm_h200.md": "Batched GEMM against cuBLAS, tuned over 73 extra tiles",
    "unfused_h200.md": "Unfused attention against fused attention and manual PyTorch",
    "sdpa_kernels_h200.md": "What each SDPA backend launches",
}

# How a current table's build was made, where its file does not say (commands, not figures).
BUILT_WITH = {
    "fa_sweep_h200.md": (
        "Built with `gemmgen generate --arch sm80 --family fa2_sm80 --family mea_sm80`, `gemmgen generate "
        "--arch sm90 --family fmha_sm90` and `gemmgen generate --arch sm90 --all --filter "
        "'fmha_sm90_.*_d64_(none_pingpong_m192n128|causal_tma_m64n64).*_lr$'` (the two tiles beside the "
        "defaults that still win somewhere), tuned with `gemmgen profile --arch sm90 --sweep fa`, measured "
        "with `python bench/fa_sweep.py --kernels`. \"pick\" is the registry's choice from the tuning "
        "database; \"pick/peer\" is the pick against the fastest SDPA backend. Every candidate's figure: "
        "[fa_sweep_h200_candidates.txt](../bench/results/fa_sweep_h200_candidates.txt)."),
    "fa_short_h200.md": ("`python bench/fa_sweep.py --dtype bf16 fp16 --head-dim 64 --seq-len 512 1024 2048 4096` "
                         "over the fmha_sm90 default build (`gemmgen generate --arch sm90 --family fmha_sm90`), untuned."),
    "fa_sweep_default_h100.md": ("`python bench/fa_sweep.py --dtype bf16 fp16 --head-dim 64 128 --rounds 3` over "
                                 "fmha_sm90's d64 / d128 default tiles without a mask and causal (10 instances), "
                                 "untuned (bench/NOTES.md, experiment 106)."),
    "fmha_pick_ab_kernels_h200.md": (
        "The build and tuning of fa_sweep_h200, measured with `python bench/ab_sweep.py --rounds 6 --kernels`."),
    "fmha_pick_ab_graph_h200.md": (
        "The build and tuning of fa_sweep_h200, measured with `python bench/ab_sweep.py --rounds 6 --graph`."),
    "fmha_pick_ab_eager_h200.md": (
        "The build and tuning of fa_sweep_h200, measured with `python bench/ab_sweep.py --rounds 6` (per call, "
        "host path included)."),
    "sm80_ab_fa2_h200.md": (
        "`python bench/ab_sweep.py --family fa2_sm80 --peer FA2 --seq-len 1024 2048 4096 8192 16384`: the "
        "fastest fa2_sm80 instance against SDPA's FlashAttention-2 backend."),
    "sm80_fa_sweep_h200.md": (
        "`python bench/fa_sweep.py` in its earlier one-pass form, over the sm80 instances built with "
        "`gemmgen generate --arch sm80 --all --filter "
        "'(d64|d128)_.*(m128n(32|64|128)w4|m64n64w4|m128n128w8)s[12]'`; \"default pick\" is the heuristic's "
        "choice without tuning data. It predates bench/NOTES.md experiment 13 (see sm80_ab_fa2_h200)."),
    "selection_value_h200.md": "`python bench/selection_value.py` over the fa2_sm80 build of sm80_fa_sweep_h200.",
    "overhead_h200.md": "`python bench/overhead.py` over the default build (`gemmgen generate --arch sm80 --arch sm90`).",
    "decode_h200.md": ("`python bench/decode.py --quick` over the default build (`gemmgen generate --arch sm80 --arch "
                       "sm90`) and mea_sm80, untuned; the dense causal rate of the chunked-prefill line is fmha_sm90's."),
    "decode_grid_h100.md": ("`python bench/decode.py --max-cache-gib 40` over decode_sm80's default instances and "
                            "fmha_sm90's bf16 d64 and d128 no-mask and causal default instances (`gemmgen generate --arch sm80 "
                            "--arch sm90 --family decode_sm80 --family fmha_sm90 --filter "
                            "\"decode_sm80|fmha_sm90_bf16_d(64|128)_(none|causal)_[a-z]+_m[0-9a-z]+_lr(_q2)?$\"`), untuned."),
    "decode_splits_h100.md": "`python bench/decode_splits.py --rounds 3` over decode_sm80's default instances.",
    "decode_splits_paged_h100.md": ("`python bench/decode_splits.py --page-size 64 --rounds 3` over decode_sm80's default "
                                    "instances; its `rule` column is the paged rule before PAGED_MIN_TILES (NOTES 96)."),
    "decode_grid_h200.md": ("`python bench/decode.py --max-cache-gib 40` over the default build (`gemmgen generate "
                            "--arch sm80 --arch sm90`) and mea_sm80, untuned."),
    "model_h100.md": "`python bench/model.py` over the default build (`gemmgen generate --arch sm80 --arch sm90`), untuned.",
    "model_h200.md": "`python bench/model.py` over the default build (`gemmgen generate --arch sm80 --arch sm90`), untuned.",
    "gqa_prefill_h200.md": ("`python bench/gqa_prefill.py` over the default build (`gemmgen generate --arch sm80 "
                            "--arch sm90`), untuned."),
    "unfused_h200.md": "`python bench/unfused.py`.",
    "batched_gemm_default_h200.md": (
        "`python bench/batched_gemm.py` over the GEMM default build (`gemmgen generate --arch sm80 --arch sm90 "
        "--family gemm_sm80 --family gemm_sm90 --family softmax_sm80`), untuned."),
    "batched_gemm_default_bf16_h200.md": (
        "`python bench/batched_gemm.py --dtype bf16 --mn 512 1024 2048 4096` over the GEMM default build, untuned."),
    "batched_gemm_default_h100.md": "`python bench/batched_gemm.py` over the GEMM default build, untuned.",
    "batched_gemm_default_bf16_h100.md": (
        "`python bench/batched_gemm.py --dtype bf16 --mn 512 1024 2048 4096` over the GEMM default build, untuned."),
    "batched_gemm_issue_h100.md": (
        "`python bench/batched_gemm.py --bh 256 --mn 4096 --k 64 --max-gb 20` over the GEMM default build, untuned "
        "(the shapes over the grid's 8 GB cut, and the long-K shapes every run appends)."),
    "sdpa_kernels_h200.md": "`python bench/sdpa_kernels.py`.",
}

GPU_RE = re.compile(r"NVIDIA [A-Z]\d{2,4}\w*")
EXPERIMENT_RE = re.compile(r"^## (\d+)\. ", re.MULTILINE)
HEADING_RE = re.compile(r"^(#{1,6})\s+(.*\S)\s*$")
FENCE = "```"


def experiments_citing(notes: str) -> dict[str, list[int]]:
    """For every file name under bench/results, the numbers of the NOTES.md experiments citing it."""
    starts = [(m.start(), int(m.group(1))) for m in EXPERIMENT_RE.finditer(notes)]
    cited: dict[str, list[int]] = {}
    for i, (start, number) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else len(notes)
        section = notes[start:end]
        for path in sorted(RESULTS.iterdir()):
            if re.search(rf"(?<![\w/.-]){re.escape(path.name)}|results/{re.escape(path.name)}", section):
                cited.setdefault(path.name, []).append(number)
    return cited


def cites(numbers: list[int]) -> str:
    """'bench/NOTES.md experiment 7' or 'bench/NOTES.md experiments 7, 29'."""
    return f"bench/NOTES.md experiment{'s' if len(numbers) > 1 else ''} " + ", ".join(map(str, numbers))


def body(lines: list[str], name: str) -> list[str]:
    """The file's lines as the section shows them: headings two levels down, fenced blocks replaced by
    a pointer to the file, a blank line before a table that follows a line of text."""
    out: list[str] = []
    fence: list[str] | None = None
    for line in lines:
        if fence is not None:
            if line.startswith(FENCE):
                n = len(fence)
                out.append(f"*({n} line{'s' if n != 1 else ''} of raw output: see {name})*")
                fence = None
            else:
                fence.append(line)
            continue
        if line.startswith(FENCE):
            fence = []
            continue
        m = HEADING_RE.match(line)
        if m:
            line = "#" * min(6, len(m.group(1)) + 2) + " " + m.group(2)
        if line.startswith("|") and out and out[-1].strip() and not out[-1].startswith("|"):
            out.append("")
        out.append(line)
    if fence is not None:  # an unclosed fence: keep its text as the file has it
        out += [FENCE, *fence]
    while out and not out[-1].strip():
        out.pop()
    return out


def section(path: Path, title: str | None, cited: list[int]) -> list[str]:
    """The docs section of one result file."""
    text = path.read_text()
    lines = text.splitlines()
    while lines and not lines[0].strip():
        lines.pop(0)
    own = HEADING_RE.match(lines[0]) if lines else None
    if own:
        lines = lines[1:]
        while lines and not lines[0].strip():
            lines.pop(0)
    stem = path.stem
    shown = title or (own.group(2) if own else None)
    out = [f'<a id="{stem}"></a>', "", f"### {stem}" + (f": {shown}" if shown else ""), ""]
    gpu = GPU_RE.search(text)
    facts = [f"File: [bench/results/{path.name}](../bench/results/{path.name})",
             f"GPU: {gpu.group(0) if gpu else 'not named in the file'}"]
    if cited:
        facts.append("cited in " + cites(cited))
    out += ["; ".join(facts) + ".", ""]
    if path.name in BUILT_WITH:
        out += [BUILT_WITH[path.name], ""]
    out += body(lines, path.name) + [""]
    return out


INTRO = """\
# Benchmarks

Generated by `python bench/make_docs.py` from the committed result files in
[bench/results](../bench/results); do not edit it by hand (`python bench/make_docs.py --check` fails
when it is stale). Every table below is copied verbatim from the file named above it, which also
names the GPU, the software versions and the date of the run. The scripts that wrote them are in
[bench/](../bench), and [bench/NOTES.md](../bench/NOTES.md) records each experiment: the prediction,
the change and what was measured.

Conventions: attention TFLOP/s = 4·B·H·Nq·Nk·d / time, halved for causal; GEMM TFLOP/s =
2·B·H·M·N·K / time. The FlashAttention sweep holds B·N = 16384 tokens and H·d = 2048, Nq = Nk = N.
"FA2", "efficient" and "cuDNN" are torch SDPA's backends, timed in the same process on the same
inputs. "Kernels alone" means each call was queued behind a spin kernel so that the CUDA events time
the GPU work only; "graph" means calls replayed back to back from a CUDA graph; "per call" or "eager"
includes the host path. Which mode a table used is in its file's first line.
"""


def render() -> str:
    """The text of docs/benchmarks.md."""
    notes = NOTES.read_text() if NOTES.is_file() else ""
    cited = experiments_citing(notes)
    md = sorted(p for p in RESULTS.glob("*.md"))
    current = [RESULTS / name for name in CURRENT if (RESULTS / name).is_file()]
    rest = sorted((p for p in md if p.name not in CURRENT),
                  key=lambda p: (cited.get(p.name, [10**6])[0], p.name))
    out = [INTRO, "## Contents", "", "Current tables:", ""]
    out += [f"- [{p.stem}](#{p.stem}): {CURRENT[p.name]}" for p in current]
    out += ["", "Experiment tables (the runs behind bench/NOTES.md, in the order of the experiments):", ""]
    for p in rest:
        nums = cited.get(p.name)
        out.append(f"- [{p.stem}](#{p.stem})" + (f" (experiment {nums[0]})" if nums else ""))
    out += ["", "## Current tables", ""]
    for p in current:
        out += section(p, CURRENT[p.name], cited.get(p.name, []))
    out += ["## Experiment tables", ""]
    for p in rest:
        out += section(p, None, cited.get(p.name, []))
    others = sorted(p for p in RESULTS.iterdir() if p.is_file() and p.suffix != ".md")
    if others:
        out += ["## Other result files", "",
                "Logs, candidate lists and plots (not tables), as the bench scripts wrote them:", ""]
        for p in others:
            nums = cited.get(p.name)
            out.append(f"- [bench/results/{p.name}](../bench/results/{p.name})" + (f" ({cites(nums)})" if nums else ""))
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/benchmarks.md is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUT.read_text() if OUT.is_file() else None
        if current != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run `python bench/make_docs.py`", file=sys.stderr)
            return 1
        print(f"{OUT.relative_to(ROOT)} is up to date")
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    if not OUT.is_file() or OUT.read_text() != text:
        OUT.write_text(text)
        print(f"wrote {OUT.relative_to(ROOT)} ({len(text)} characters)")
    else:
        print(f"{OUT.relative_to(ROOT)} is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
