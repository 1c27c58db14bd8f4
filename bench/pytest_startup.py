"""What installing hostcallback costs an unrelated project's pytest run.

Times ``python -m pytest`` on a one-test project in a temporary folder, with the plugin that
hostcallback registers (entry point ``hostcallback``) and with it blocked (``-p no:hostcallback``),
the two alternated so that a change in the machine's load hits both alike. The test checks that
the plugin is loaded or not as intended, so a run cannot time the same set-up twice.

  with plugin, without plugin   best wall time of a whole pytest run, start to exit
  ratio                         with / without: 1.0 means the plugin costs nothing

Usage: python bench/pytest_startup.py [--runs 7]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
import time

PLUGIN_NAME = "hostcallback"

ONE_TEST = textwrap.dedent(f"""
    import os

    def test_plugin_is_loaded_as_intended(request):
        expected = os.environ["EXPECT_PLUGIN"] == "1"
        assert request.config.pluginmanager.has_plugin({PLUGIN_NAME!r}) == expected
    """)


def time_one_run(project: str, with_plugin: bool) -> float:
    environment = {name: value for name, value in os.environ.items()
                   if name not in ("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "PYTEST_ADDOPTS")}
    environment["EXPECT_PLUGIN"] = "1" if with_plugin else "0"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    if not with_plugin:
        command += ["-p", f"no:{PLUGIN_NAME}"]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=project, env=environment, capture_output=True,
                            text=True, check=False)
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"pytest failed ({'with' if with_plugin else 'without'} the plugin):\n"
                         + result.stdout + result.stderr)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="runs of each set-up (best counts)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as project:
        with open(os.path.join(project, "test_one.py"), "w") as file:
            file.write(ONE_TEST)
        time_one_run(project, with_plugin=True)  # warms the file cache and the .pyc files
        with_plugin, without_plugin = [], []
        for _ in range(args.runs):
            with_plugin.append(time_one_run(project, with_plugin=True))
            without_plugin.append(time_one_run(project, with_plugin=False))
    best_with, best_without = min(with_plugin), min(without_plugin)
    print(f"pytest start-up, one-test project, best of {args.runs} runs each")
    print(f"  with plugin      {best_with:6.3f} s")
    print(f"  without plugin   {best_without:6.3f} s   (-p no:{PLUGIN_NAME})")
    print(f"  ratio            {best_with / best_without:6.2f}")


if __name__ == "__main__":
    main()
