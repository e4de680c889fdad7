"""Hostile model files are refused in one line, before any kernel sees a weight.

GGUF files come from the internet. Measured on SmolLM2's file with one lie each: layer 0's q
projection with twice its rows killed the process (`malloc(): invalid size`, the native code
writing past a buffer sized from the settings); a doubled MLP matrix or a half embedding ran
and answered; a head count that does not divide the width ended in a traceback. Here a tiny
valid file is written, then variants that each tell one lie (tests/helpers/gguf_files.py), and:

- every lie ends in one `ModelLoadError` line that names the file and what is wrong (the
  tensor with its shape and the expected one, or the setting), and nothing escapes;
- the valid file loads and generates (the positive control, in the same process);
- the command line on a lying file exits 2 with one line on stderr, no traceback;
- negative controls: with the whole-model check (`shapes.check`) switched off, the half
  embedding loads and answers (so the check, not luck, refuses it), and the doubled matrices
  are stopped by the kernels' own size checks (ValueError), not by a crash;
- a Hugging Face folder whose config lies is refused before its weights are read.

The files are loaded in a child process, one for all of them (each start imports torch and
transformers, ~5 s), so a crash fails the test naming the file it was on instead of killing
pytest; the child prints a JSON line as it starts a file and one with the outcome.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.helpers import ROOT
from tests.helpers.models import CPU, make_hf
from tests.helpers.native import needs_compiler
from gguf import GGMLQuantizationType as Q
from tests.helpers.gguf_files import patch_tensor_info, write_gguf

from triforce_core.models.loading import ModelLoadError, load_model

pytestmark = needs_compiler
# 6 layers: the measured lies were in layers 0, 3 and 5. Width 64, 4 heads (2 KV) of 16, MLP 128.
TINY = dict(num_hidden_layers=6, num_key_value_heads=2)
# The valid file's q and k are Q5_0, its other matrices Q8_0 (as a Q4_K_M file keeps the
# projections whose rows are not a multiple of 256): the lies that edit its bytes lie about those.
VALID_TYPES = {"attn_q.weight": Q.Q5_0, "attn_k.weight": Q.Q5_0}
CHILD_TIMEOUT_S = 240  # a heap overrun may hang instead of abort (seen): then the test fails, naming the file


def _one(target: str, how):
    """An `edit` that changes only the tensor `target`."""
    return lambda name, a: how(name, a) if name == target else [(name, a)]


def _twice(name, a):
    return [(name, np.concatenate([a, a]))]


# name -> (writer arguments, or a function of the valid file's bytes; what the line must say after "<file>: ")
LIES = {
    "attn_q_twice": (dict(edit=_one("blk.0.attn_q.weight", _twice)),
                     r"blk\.0\.attn_q\.weight is \[128, 64\], expected \[64, 64\] \(heads 4 x head size 16, width 64\)"),
    "ffn_down_twice": (dict(edit=_one("blk.3.ffn_down.weight", _twice)),
                       r"blk\.3\.ffn_down\.weight is \[128, 128\], expected \[64, 128\] \(width 64, MLP width 128\)"),
    "ffn_gate_twice": (dict(edit=_one("blk.5.ffn_gate.weight", _twice)),
                       r"blk\.5\.ffn_gate\.weight is \[256, 64\], expected \[128, 64\] \(MLP width 128, width 64\)"),
    "token_embd_half": (dict(edit=_one("token_embd.weight", lambda n, a: [(n, a[: len(a) // 2])])),
                        r"token_embd\.weight is \[48, 64\], expected \[97, 64\] \(vocabulary 97, width 64\)"),
    "output_vocab": (dict(edit=_one("output.weight", lambda n, a: [(n, a[:-1])])),
                     r"output\.weight is \[96, 64\], expected \[97, 64\]"),
    "head_count_7": (dict(settings={"head_count": 7}), r"llama\.attention\.head_count 7 does not divide llama\.embedding_length 64"),
    "head_count_kv_3": (dict(settings={"head_count_kv": 3}), r"head_count 4 is not a multiple of llama\.attention\.head_count_kv 3"),
    "embedding_2_20": (dict(settings={"embedding_length": 2**20}), r"llama\.embedding_length is 1048576, outside 1\.\.65,536"),
    "block_count_300": (dict(settings={"block_count": 300}),
                        r"blk\.6\.attn_norm\.weight is missing: the file declares 300 layers and has tensors for 6"),
    "block_count_0": (dict(settings={"block_count": 0}), r"llama\.block_count is 0, outside 1\.\.1,024"),
    "mlp_width_96": (dict(settings={"feed_forward_length": 96}),
                     r"blk\.0\.ffn_gate\.weight is \[128, 64\], expected \[96, 64\] \(MLP width 96, width 64\)"),
    "missing_tensor": (dict(edit=_one("blk.2.attn_v.weight", lambda n, a: [])), r"blk\.2\.attn_v\.weight is missing"),
    "extra_layer": (dict(edit=_one("blk.5.ffn_up.weight", lambda n, a: [(n, a), ("blk.6.ffn_up.weight", a)])),
                    r"blk\.6\.ffn_up\.weight belongs to layer 6, but the file declares 6 layers \(0-5\)"),
    "unknown_tensor": (dict(edit=_one("blk.1.ffn_up.weight", lambda n, a: [(n, a), ("blk.1.ffn_up_exps.weight", a)])),
                       r"unexpected tensor blk\.1\.ffn_up_exps\.weight for a llama decoder"),
    "iq4_nl": (dict(types={"ffn_up.weight": Q.IQ4_NL}), r"tensor blk\.0\.ffn_up\.weight is IQ4_NL, which is not supported"),
    # 48 inputs a row: not a whole number of Q5_0's 32-weight blocks (33 bytes a row)
    "q5_0_rows_of_48": (lambda path: patch_tensor_info(path, "blk.2.attn_q.weight", dims=(48, 64)),
                        r"is not a readable GGUF file \(Quantized tensor row size \(48\) is not a multiple of Q5_0"),
    "type_99": (lambda path: patch_tensor_info(path, "blk.1.attn_k.weight", qtype=99),
                r"is not a readable GGUF file \(.*99\)? is not a valid GGMLQuantizationType"),
    "offset_past_end": (lambda path: patch_tensor_info(path, "blk.5.ffn_down.weight", offset=1 << 40),
                        r"is not a readable GGUF file"),
    "truncated": (lambda path: path.write_bytes(path.read_bytes()[: path.stat().st_size * 2 // 3]),
                  r"is not a readable GGUF file"),
    "junk_after_magic": (lambda path: path.write_bytes(b"GGUF" + np.random.default_rng(0).bytes(4000)),
                         r"is not a readable GGUF file"),
}
# Lies the kernels' own size checks must stop when the whole-model check is off.
KERNEL_CAUGHT = ("attn_q_twice", "ffn_down_twice", "ffn_gate_twice")

CHILD = r"""
import json, sys, traceback
import torch
from triforce_core import GenerationConfig, SpeculationConfig, TriForceEngine
from triforce_core.models import loading, shapes

check = shapes.check
cfg = GenerationConfig(speculation=SpeculationConfig(mode="autoregressive", max_new_tokens=4, ignore_eos=True))
for arg in sys.argv[1:]:
    mode, path = arg.split("=", 1)
    # "unchecked": the negative control, the whole-model check off for this file
    shapes.check = check if mode == "checked" else (lambda *args, **kwargs: None)
    print(json.dumps({"file": arg, "started": True}), flush=True)
    try:
        loaded = loading.load_model(path, torch.device("cpu"), torch.float32)
        tokens = TriForceEngine(loaded.model, None).run([3, 4, 5, 6, 7], cfg).token_ids
        out = {"outcome": "generated", "tokens": tokens}
    except loading.ModelLoadError as e:
        out = {"outcome": "refused", "type": type(e).__name__, "message": str(e)}
    except Exception as e:
        out = {"outcome": "escaped", "type": type(e).__name__, "message": str(e), "traceback": traceback.format_exc()}
    print(json.dumps({"file": arg, **out}), flush=True)
"""


def load_in_child(loads: list[tuple[str, Path]]) -> dict[tuple[str, str], dict]:
    """Each (mode, file)'s outcome, by (mode, file name), loaded one after another in one child
    process. Fails the test, naming the file, if the child dies by a signal or hangs."""
    args = [f"{mode}={path}" for mode, path in loads]
    proc = subprocess.Popen([sys.executable, "-c", CHILD, *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    hung = False
    try:
        stdout, stderr = proc.communicate(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        hung = True
        proc.kill()
        stdout, stderr = proc.communicate()
    outcomes: dict[tuple[str, str], dict] = {}
    current = None
    for line in stdout.splitlines():
        if not line.startswith('{"file": '):
            continue  # a library's own print
        row = json.loads(line)
        mode, path = row["file"].split("=", 1)
        if row.get("started"):
            current = (mode, Path(path).name)
        else:
            outcomes[(mode, Path(path).name)], current = row, None
    if current is not None or proc.returncode != 0:
        how = (f"hung for {CHILD_TIMEOUT_S} s" if hung else f"killed by signal {-proc.returncode}" if proc.returncode < 0
               else f"exit {proc.returncode}")
        pytest.fail(f"the loader's process ended ({how}) while loading {current}: {stderr[-2000:]}")
    return outcomes


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """The valid file and every lying variant of it."""
    folder = tmp_path_factory.mktemp("hostile")
    hf = make_hf("llama_mha", seed=3, **TINY)
    made = {"valid": write_gguf(hf, folder / "valid.gguf", VALID_TYPES)}
    for name, (how, _) in LIES.items():
        path = folder / f"{name}.gguf"
        if callable(how):
            path.write_bytes(made["valid"].read_bytes())
            how(path)
        else:
            how = dict(how)
            write_gguf(hf, path, how.pop("types", {}), **how)
        made[name] = path
    return made


@pytest.fixture(scope="module")
def command_line(files):
    """The command line on a lying file, started before the loader's child (`outcomes`) so the
    two processes' imports overlap."""
    cmd = [sys.executable, "-m", "triforce_core", "generate", "--target", str(files["attn_q_twice"]), "--prompt", "Hello"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield proc
    if proc.poll() is None:  # its test was not run
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def outcomes(files, command_line) -> dict[tuple[str, str], dict]:
    """Every file checked, then the negative controls' files unchecked, in one child."""
    unchecked = ["token_embd_half", *KERNEL_CAUGHT]
    return load_in_child([("checked", p) for p in files.values()] + [("unchecked", files[n]) for n in unchecked])


def test_the_valid_file_loads_and_generates(outcomes):
    """The positive control: the same child, the same loader, the file the lies were made from."""
    valid = outcomes[("checked", "valid.gguf")]
    assert valid["outcome"] == "generated" and len(valid["tokens"]) == 4, valid


@pytest.mark.parametrize("lie", list(LIES))
def test_every_lie_is_one_line_naming_the_file_and_the_fault(outcomes, lie):
    got = outcomes[("checked", f"{lie}.gguf")]
    assert got["outcome"] == "refused", f"{lie}: {got}"
    message = got["message"]
    assert "\n" not in message and "Traceback" not in message
    assert message.startswith(f"{lie}.gguf"), message
    assert re.search(LIES[lie][1], message), f"{lie}: {message!r} does not say {LIES[lie][1]!r}"


def test_without_the_whole_model_check_the_kernels_still_refuse_and_a_lie_gets_through(outcomes):
    """Negative control of the check above, and the kernels' last line of defence: with
    `shapes.check` off, the half embedding loads (nothing else refuses it: on SmolLM2 it then
    answered; here the head, 97 rows, soon picks an id past the embedding's 48 and the lookup
    fails mid-answer), and each doubled matrix is stopped by the kernels' size checks at the
    Python call: a ValueError, no crash (the child would die by a signal and fail this test
    naming the file)."""
    half = outcomes[("unchecked", "token_embd_half.gguf")]
    assert half["outcome"] != "refused", half
    for lie in KERNEL_CAUGHT:
        row = outcomes[("unchecked", f"{lie}.gguf")]
        assert row["outcome"] == "escaped" and row["type"] == "ValueError", f"{lie}: {row}"
        assert re.search(r"(projection|outputs|weights)", row["message"]), row["message"]


def test_the_command_line_prints_one_line_and_exits_2(command_line):
    try:
        _, stderr = command_line.communicate(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        command_line.kill()
        _, stderr = command_line.communicate()
    assert command_line.returncode == 2, (command_line.returncode, stderr[-2000:])
    assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    assert re.fullmatch(r"error: attn_q_twice\.gguf: " + LIES["attn_q_twice"][1] + r"\n", stderr), stderr


def test_a_hugging_face_config_that_lies_is_refused_before_its_weights(tmp_path):
    """The same checks on a checkpoint folder: a width no model has is refused from config.json
    alone (transformers would otherwise build 2^20-wide layers, gigabytes, before any check)."""
    folder = tmp_path / "liar"
    make_hf("llama_mha", seed=1).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": 2**20}))
    with pytest.raises(ModelLoadError, match=r"width \(hidden_size\) is 1048576, outside 1\.\.65,536") as e:
        load_model(str(folder), CPU, torch.float32)
    assert "\n" not in str(e.value) and str(folder) in str(e.value)


def test_a_hugging_face_folder_missing_a_tensor_is_refused(tmp_path):
    """transformers fills a tensor missing from the weights with random numbers and only warns;
    the loader refuses it. The control: the folder before the tensor is dropped loads."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "holed"
    make_hf("llama_mha", seed=1).save_pretrained(folder)
    assert load_model(str(folder), CPU, torch.float32).model.spec.num_layers == 2
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.self_attn.v_proj.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.v_proj\.weight is missing from the weights") as e:
        load_model(str(folder), CPU, torch.float32)
    assert "\n" not in str(e.value) and str(e.value).startswith(str(folder))
