"""The entry points import the heavy libraries with the cyclic garbage collector paused, then
freeze what the imports made and run the collector again (`triforce_core.cli.startup`).

Each check runs in a child process: freezing is for the whole process, and the test process's
own objects must stay collectable for the tests that count on it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from conftest import ROOT


def _child(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_the_collector_is_off_in_the_block_and_what_it_made_is_frozen_after():
    out = _child("""
        import gc
        from triforce_core.cli.startup import collector_paused
        before = gc.get_freeze_count()
        with collector_paused():
            inside = gc.isenabled()
            made = [[i] for i in range(50_000)]
        print(inside, gc.isenabled(), gc.get_freeze_count() - before >= 50_000)
    """)
    assert out == "False True True"


def test_a_collector_the_caller_turned_off_stays_off_and_nothing_is_frozen():
    out = _child("""
        import gc
        from triforce_core.cli.startup import collector_paused
        gc.disable()
        with collector_paused():
            made = [[i] for i in range(1_000)]
        print(gc.isenabled(), gc.get_freeze_count())
    """)
    assert out == "False 0"


def test_an_error_in_the_block_still_runs_the_collector_again():
    out = _child("""
        import gc
        from triforce_core.cli.startup import collector_paused
        try:
            with collector_paused():
                raise ValueError("bad")
        except ValueError:
            pass
        print(gc.isenabled())
    """)
    assert out == "True"


def test_the_command_line_imports_its_libraries_that_way():
    # a model that is not there: the command line has imported torch, transformers and the
    # engine before it says so, and leaves them frozen with the collector on
    out = _child("""
        import gc
        from triforce_core.cli.main import main
        code = main(["generate", "--target", "no-such-model.gguf", "--prompt", "Hello"])
        print(code, gc.isenabled(), gc.get_freeze_count() > 100_000)
    """)
    assert out == "2 True True"
