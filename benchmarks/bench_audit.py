"""How long ``streampack audit`` takes for a run of 10^6 steps, against recomputing the same positions'
order alone (the floor: the audit asks the order of every position trained, in chunks).

    python benchmarks/bench_audit.py [--steps 1000000] [--batch-size 8] [--repeats 3]

Two runs: one dataset of 10^6 samples resumed twice (a batch-size change), and a mixture of three sources
resumed twice with a weight change. Prints the median seconds of each, and its ratio to the floor.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from streampack import Loader, Mixture
from streampack.runs.audit import audit


def _run(data: object, steps: int, batch: int, mixed: bool) -> dict:
    def make(b: int, weights: dict[str, int] | None = None) -> Loader:
        if mixed:
            return Loader(Mixture(data, weights or {"a": 5, "b": 3, "c": 2}, seed=1), batch_size=b)  # type: ignore[arg-type]
        return Loader(data, batch_size=b, seed=1)  # type: ignore[arg-type]

    first = make(batch)
    first.advance(steps // 2)
    second = make(batch * 2, {"a": 1, "b": 1, "c": 1})
    second.load_state_dict(first.state_dict(), step=steps // 2)
    second.advance(steps // 4)
    third = make(batch)
    third.load_state_dict(second.state_dict(), step=steps // 2 + steps // 4)
    third.advance(steps - steps // 2 - steps // 4)
    return third.state_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    one = np.zeros((1_000_000, 2), dtype=np.int32)
    three = {
        name: np.zeros((n, 2), dtype=np.int32) for name, n in (("a", 600_000), ("b", 300_000), ("c", 100_000))
    }
    print(f"{'run':<24} {'positions':>12} {'audit s':>9} {'floor s':>9} {'ratio':>7}")
    for label, data, mixed in (("one dataset", one, False), ("mixture of 3", three, True)):
        state = _run(data, args.steps, args.batch_size, mixed)
        given = Mixture(data, {"a": 1}, seed=1) if mixed else data  # type: ignore[arg-type]
        audits, floors = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            report = audit(state, given)
            audits.append(time.perf_counter() - start)
            assert report.clean
            loader = (
                Loader(given, batch_size=args.batch_size) if mixed else Loader(data, batch_size=8, seed=1)
            )  # type: ignore[arg-type]
            start = time.perf_counter()
            for lo in range(0, state["position"], 1 << 20):
                loader.served(lo, min(state["position"], lo + (1 << 20)))
            floors.append(time.perf_counter() - start)
        a, f = statistics.median(audits), statistics.median(floors)
        print(f"{label:<24} {state['position']:>12,} {a:>9.2f} {f:>9.2f} {a / f:>7.2f}")


if __name__ == "__main__":
    main()
