"""The whole configuration: one section per part of the system, and the checks that span sections."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from rapo_ray.algos.registry import ENTRY_POINT_GROUP, algorithm_of
from rapo_ray.config.sections import (
    AlgoConfig,
    CheckpointConfig,
    ColdStartConfig,
    LearnerConfig,
    ModelConfig,
    ResourcesConfig,
    RetrievalConfig,
    RolloutConfig,
    RunConfig,
    ServeConfig,
    SyncConfig,
    TasksConfig,
    TokenizerConfig,
    TrainerConfig,
    require,
)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "Model."})
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig, metadata={"help": "Tokenizer."})
    tasks: TasksConfig = field(default_factory=TasksConfig, metadata={"help": "Tasks and data."})
    rollout: RolloutConfig = field(default_factory=RolloutConfig, metadata={"help": "Rollout fleet and sampling."})
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig, metadata={"help": "Step-trace retrieval."})
    algo: AlgoConfig = field(default_factory=AlgoConfig, metadata={"help": "Algorithm."})
    learner: LearnerConfig = field(default_factory=LearnerConfig, metadata={"help": "Learner group."})
    sync: SyncConfig = field(default_factory=SyncConfig, metadata={"help": "Weight sync."})
    resources: ResourcesConfig = field(default_factory=ResourcesConfig, metadata={"help": "Ray resources."})
    trainer: TrainerConfig = field(default_factory=TrainerConfig, metadata={"help": "Training loop."})
    cold_start: ColdStartConfig = field(
        default_factory=ColdStartConfig, metadata={"help": "Cold-start SFT of a real model (model.preset, model.path)."}
    )
    run: RunConfig = field(default_factory=RunConfig, metadata={"help": "Run directory and logging."})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata={"help": "Checkpoints."})
    serve: ServeConfig = field(
        default_factory=ServeConfig, metadata={"help": "Serving the trained agent (jobs/serve.py)."}
    )

    @property
    def colocated_pairs(self) -> int:
        """Learner ranks whose placement-group bundle also holds a rollout worker: ranks 0..rollout.num_workers-1
        when ``resources.colocate`` is true (``validate`` keeps rollout.num_workers <= learner.world_size), else 0.
        What the learners' bundles are (``workers/learner.py``) and what they reserve (``launch/plan.py``) both
        read it."""
        return min(self.rollout.num_workers, self.learner.world_size) if self.resources.colocate is True else 0

    def validate(self) -> "Config":
        """Each section's own checks, the running algorithm's, then those across sections; raise ConfigError naming
        the field."""
        algorithm = algorithm_of(self.algo)  # an unknown name is refused there, with the registered ones
        require(
            algorithm.settings is None or hasattr(self.algo, algorithm.name),
            f"algo.name={algorithm.name}: the algorithm has its own settings (algo.{algorithm.name}), but it registered "
            f"after the configuration was built (through algo.modules); install its module as an entry point in the "
            f"group {ENTRY_POINT_GROUP} so that its section exists (rapo_ray/algos/registry.py)",
        )
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate()
        algorithm.validate(self.algo)
        m, r, t = self.model, self.rollout, self.trainer
        require(
            bool(m.path) or r.max_response_tokens < m.max_position_embeddings,  # an HF model's own is checked at load
            f"rollout.max_response_tokens ({r.max_response_tokens}) must be < model.max_position_embeddings "
            f"({m.max_position_embeddings})",
        )
        require(
            not self.tasks.families
            or self.tasks.train_size >= 2 * (t.sft_examples + t.sft_hard_examples) + t.rl_questions,
            f"tasks.train_size ({self.tasks.train_size}) must be >= 2 x (trainer.sft_examples + "
            "trainer.sft_hard_examples) + trainer.rl_questions, so RL questions are disjoint from the warm-start ones",
        )
        require(
            not (self.cold_start.examples and m.bundled),
            "cold_start.examples is for a real model (model.preset or model.path); the bundled model has its warm "
            "start (trainer.sft_*)",
        )
        require(
            self.cold_start.source != "families" or not self.cold_start.examples or bool(self.tasks.families),
            "cold_start.source=families draws the scripted expert's solutions of tasks.families, and none is set",
        )
        require(
            not (self.retrieval.buffer_source == "scripted-expert" and self.tasks.data_files),
            f"retrieval.buffer_source=scripted-expert solves only the bundled families, not tasks.data_files "
            f"{self.tasks.data_files}; use retrieval.buffer_source=policy (the starting policy samples the buffer)",
        )
        if self.resources.colocate is True:
            require(
                r.num_workers <= self.learner.world_size and not r.autoscale,
                f"resources.colocate=true places each rollout worker beside one learner rank: rollout.num_workers "
                f"({r.num_workers}) must be <= learner.world_size ({self.learner.world_size}) and rollout.autoscale "
                f"({r.autoscale}) must be false",
            )
            require(
                self.resources.colocated_gpus <= 1,
                f"resources.colocate=true puts a learner rank and its rollout worker on one GPU: "
                f"resources.gpus_per_learner ({self.resources.gpus_per_learner}) and gpus_per_rollout_worker "
                f"({self.resources.gpus_per_rollout_worker}) must be <= 1",
            )
            require(
                self.resources.colocated_gpus == 0 or self.learner.world_size == 1,
                f"resources.colocate=true on GPUs takes learner.world_size=1 (one shared GPU; got "
                f"{self.learner.world_size}): an engine opens its learner's CUDA buffer by IPC, which names the device "
                "as the learner sees it",
            )
        require(
            not (self.retrieval.buffer_source == "solutions" and not self.tasks.data_files),
            "retrieval.buffer_source=solutions reads the human solutions of tasks.data_files, and none is set",
        )
        return self
