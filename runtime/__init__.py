"""The Qwen3.5 engine: config, weights loading, model (model.py; mixers.py: norms, attention, GatedDeltaNet), caches
and GDN state, generation (generate.py: the loop; rounds.py: a decode step or an MTP round, written once; prefill.py;
graphs.py: captured steps; run_options.py: how a command runs, decided once), the self-test (selftest/), and its
several-device mode (parallel.py: which part a rank holds; expert_parallel.py: the MoE dispatch; ranks.py: one
process per device; lockstep.py: rank 0 drives, the others follow), and text in, text out (text_completions.py;
completion.py: a completion, whoever made it); its judge lives in runtime.validation, its server in
runtime.serving. Imports kernels, convert (to read checkpoints) and the shared helpers; never those two."""
