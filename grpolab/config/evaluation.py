"""The `eval:` section: how held-out evaluations report."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation (`grpolab eval`, the pipeline's evaluations after SFT and after GRPO)."""

    group_by: tuple[str, ...] | str = ()
    """Metadata fields (data columns other than the prompt, e.g. `kind`, or [kind, source]) to break
    every metric down by: the result gains `by.FIELD.VALUE` with the same metrics over the held-out
    prompts of that value (rows without the field: `null`). A field no held-out row has is an error."""

    @property
    def group_fields(self) -> tuple[str, ...]:
        """group_by as a tuple (a single field may be given as a string)."""
        return (self.group_by,) if isinstance(self.group_by, str) else tuple(self.group_by)
