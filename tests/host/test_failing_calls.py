"""A call function that fails every other time: those computations fail, the rest succeed."""

import jax
import numpy as np

import hostcallback as hcb


def test_every_other_call_fails_clearly_and_the_others_return(transport):
    def flaky(v):
        if int(v) % 2:
            raise ValueError(f"odd {int(v)}")
        return np.asarray(v) * 10

    run = jax.jit(lambda x: hcb.call(flaky, x, result_shape=x))
    answers, failures = [], []
    for i in range(6):
        try:
            answers.append(int(run(np.int32(i))))
        except Exception as error:  # noqa: BLE001 (the computation fails; the process lives on)
            failures.append(str(error))
    assert answers == [0, 20, 40]
    assert len(failures) == 3 and all("call consumer flaky failed: ValueError: odd" in f
                                      for f in failures)
    hcb.barrier_wait()  # each failure was reported once, by its computation, not again here
