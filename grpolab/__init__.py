"""grpolab: GRPO and the SFT-to-GRPO spectrum.

From Python: `grpolab.make_config`, `grpolab.train`, `grpolab.train_sft`, `grpolab.train_rm`,
`grpolab.evaluate`, `grpolab.export`, `grpolab.pipeline`, `grpolab.Callback` (grpolab/api/, imported
on first use, so `import grpolab` stays cheap; `grpolab.sft` is the SFT package, `grpolab.api.sft` the function).
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    import importlib

    api = importlib.import_module("grpolab.api")
    if name in api.__all__ and name != "sft":  # grpolab.sft is the package (grpolab.train_sft the function)
        return getattr(api, name)
    raise AttributeError(f"module 'grpolab' has no attribute {name!r}")
