"""Hydra entry point: ``python -m jobs.train_pair [train=smoke] [output_dir=...]``.

Thin on purpose: it turns the composed config into typed specs and calls
``pipeline.train_pair.training.train_pair``. Tests call :func:`run` with a composed config.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig, OmegaConf

from pipeline.train_pair.spec import train_spec_from_mapping
from pipeline.train_pair.training import TrainingResult, train_pair


def run(cfg: DictConfig) -> TrainingResult:
    spec = train_spec_from_mapping(OmegaConf.to_container(cfg.train, resolve=True))
    return train_pair(spec, cfg.output_dir, show_progress=bool(cfg.show_progress))


@hydra.main(config_path="../conf", config_name="train_pair", version_base="1.3")
def main(cfg: DictConfig) -> None:
    result = run(cfg)
    print(f"saved the pair to {result.output_dir}: {result.steps} steps, {result.tokens_seen} tokens, "
          f"{result.train_seconds / 60:.1f} min, stopped by {result.stopped_by}, "
          f"target loss {result.final_target_loss:.3f}, draft CE {result.final_draft_loss:.3f}")


if __name__ == "__main__":
    main()
