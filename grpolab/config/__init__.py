"""Configuration: frozen nested dataclasses, presets of the SFT-to-GRPO spectrum, YAML, overrides.

One module per section (model, data, rollout, loss, train, sft, rewards, rm_refresh, environment, run), the
Config root with its derived sizes (config.py), the presets (presets.py), YAML and overrides
(io.py) and validation (validation.py). Everything a caller needs is re-exported here:

    from grpolab import config as C
    cfg = C.from_preset("grpo", ["train.steps=5"])
"""

from grpolab.config.config import Config, dump, from_preset, load
from grpolab.config.data import DataConfig
from grpolab.config.environment import EnvironmentConfig
from grpolab.config.evaluation import EvalConfig
from grpolab.config.loss import LossConfig
from grpolab.config.model import ModelConfig
from grpolab.config.presets import PRESETS
from grpolab.config.rewards import RewardSpec
from grpolab.config.rm_refresh import RMRefreshConfig
from grpolab.config.rollout import RolloutConfig
from grpolab.config.run import RunConfig
from grpolab.config.sft import SFTConfig
from grpolab.config.train import TrainConfig
from grpolab.errors import ConfigError

__all__ = ["Config", "ConfigError", "DataConfig", "EnvironmentConfig", "EvalConfig", "LossConfig", "ModelConfig",
           "PRESETS", "RMRefreshConfig", "RewardSpec", "RolloutConfig", "RunConfig", "SFTConfig", "TrainConfig",
           "dump", "from_preset", "load"]
