"""Early stopping from Python: GRPO on the built-in task, stopped by a callback once the held-out greedy
accuracy stops improving; the run is saved and resumable (`grpolab train ... --resume`, or resume=True).

    python examples/early_stop.py [OUT_DIR]
"""

import sys

import grpolab


class EarlyStop(grpolab.Callback):
    """Stops when the held-out accuracy (run.eval_every) has not improved for `patience` evaluations."""

    def __init__(self, patience: int = 2, key: str = "accuracy"):
        self.patience, self.key = patience, key
        self.best, self.waited = float("-inf"), 0

    def on_evaluate(self, step, metrics):
        score = metrics[self.key]
        self.best, self.waited = (score, 0) if score > self.best else (self.best, self.waited + 1)
        print(f"step {step + 1}: held-out {self.key} {score:.3f} (best {self.best:.3f})")
        return self.waited >= self.patience  # True: finish this step, save a checkpoint, stop

    def on_save(self, step, checkpoint):
        print(f"saved {checkpoint}")


def main(out_dir: str = "runs/early_stop", **overrides) -> grpolab.TrainResult:
    cfg = grpolab.make_config("grpo", {"train.steps": 200, "run.eval_every": 10, "data.eval_prompts": 64,
                                       "run.out_dir": out_dir, **overrides})
    result = grpolab.train(cfg, callbacks=[EarlyStop()])
    print(f"{result.stopped_by or 'finished'} after {len(result.metrics)} steps; checkpoint {result.checkpoint}")
    return result


if __name__ == "__main__":
    main(*sys.argv[1:2])
