"""The entry points import the heavy libraries with the cyclic garbage collector paused, then
freeze what the imports made and run the collector again (`triforce_core.cli.startup`); a
server's model loads run paused too, frozen only for the started model, which is never let go.

Each check runs in a child process: freezing is for the whole process, and the test process's
own objects must stay collectable for the tests that count on it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.helpers import ROOT


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


def test_without_freezing_the_collector_is_off_in_the_block_and_nothing_is_frozen():
    out = _child("""
        import gc
        from triforce_core.cli.startup import collector_paused
        with collector_paused(freeze=False):
            inside = gc.isenabled()
            made = [[i] for i in range(50_000)]
        print(inside, gc.isenabled(), gc.get_freeze_count())
    """)
    assert out == "False True 0"


# Counts the collector's passes over `load()` (gc.callbacks), and what is frozen after it.
_PASSES = """
        import gc
        passes = []
        def counted(phase, info):
            if phase == "start":
                passes.append(info["generation"])
        def over(load):
            gc.callbacks.append(counted)
            try:
                return load()
            finally:
                gc.callbacks.remove(counted)
"""


def test_a_servers_model_loads_run_paused_and_stay_collectable():
    # the loads the app's picker and the API's `model` make: no collector pass while the model
    # loads (one, of the young generation, as the collector runs again), the collector on after
    # it, nothing frozen (a model let go of must be freed)
    out = _child(_PASSES + """
        import app
        from triforce_core.cli.flags import served_models
        args = app.parse_args(["--target", "demo"])
        from triforce_core.serving.registry import app_model_names
        models = served_models(args, *app_model_names(args.target, args.draft), slots=1)
        engine = over(lambda: models._load(models.started))  # the registry's own load of a model
        print(len(passes) <= 1, gc.isenabled(), gc.get_freeze_count(), engine.tokenizer is not None)
    """)
    assert out == "True True 0 True"


def test_the_app_loads_its_started_model_paused_and_freezes_it_with_the_app():
    # everything imported first (its own pause then has nothing to do), the server's start
    # stopped where it would serve: no pass while the started model loads and the app is built
    # (one as the collector runs again), and they are frozen after
    out = _child(_PASSES + """
        import app
        import ui.server
        from triforce_core.cli import flags, startup
        import triforce_core.engine, triforce_core.serving.registry
        class Started(Exception):
            pass
        def serve(built, *args, **kwargs):  # the app built; frozen objects are in no generation's list
            tracked = {id(o) for o in gc.get_objects()}
            raise Started(f"{len(passes) <= 1} {gc.isenabled()} {id(built) not in tracked}")
        ui.server.run_server = serve
        try:
            over(lambda: app.main(["--target", "demo", "--port", "7999"]))
        except Started as e:
            print(e)
    """)
    assert out == "True True True"


def test_serve_loads_its_started_model_paused_and_freezes_it():
    out = _child(_PASSES + """
        from triforce_core.cli.main import build_parser
        from triforce_core.cli.serve import build_api
        import triforce_core.engine, triforce_core.serving.openai, triforce_core.serving.worker
        from triforce_core.serving.registry import ServedModels
        default = ServedModels.default
        ServedModels.default = lambda self: over(lambda: default(self))  # the started model's load
        args = build_parser().parse_args(["serve", "--slots", "1"])  # the demo pair
        api = build_api(args)
        tracked = {id(o) for o in gc.get_objects()}  # frozen objects are in no generation's list
        print(len(passes), gc.isenabled(), id(api.engine) not in tracked)
        api.worker.close()
    """)
    assert out == "0 True True"
