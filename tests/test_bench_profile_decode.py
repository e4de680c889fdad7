"""bench.profile_decode --outside on the demo pair: each round's time split into the native calls'
and the rest, the calls timed and put back as they were; counts refused in one line."""

from tests.helpers.native import needs_compiler

from bench import profile_decode
from triforce_core.models import native_layers


@needs_compiler
def test_a_rounds_time_is_split_around_the_native_calls_and_the_calls_are_restored(capsys):
    lib = native_layers.kernel().lib
    before = {name: getattr(lib, name) for name in profile_decode.NATIVE_CALLS["layers"]}
    assert profile_decode.main(["--mode", "autoregressive", "--context-tokens", "300", "--max-new-tokens", "12",
                                "--outside"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("autoregressive: 12 tokens in 12 rounds") and "outside them" in line
    native = float(line.split("native calls ")[1].split(" ms")[0])
    outside = float(line.split("outside them ")[1].split(" ms")[0])
    assert native > 0 and outside > 0  # the demo's forwards take the one-call native path
    assert all(getattr(lib, name) is f for name, f in before.items())


def test_counts_below_one_are_refused(capsys):
    assert profile_decode.main(["--max-new-tokens", "0", "--outside"]) == 2
    assert "must be positive" in capsys.readouterr().err
