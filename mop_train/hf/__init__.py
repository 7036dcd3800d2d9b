"""Hugging Face safetensors in and out, for the MLA family (HF's DeepseekV3ForCausalLM).

- names.py: our state-dict keys <-> HF names, config.json, and where the two models differ
  (the configs that cannot map are refused by name).
- export.py: `mop-train export`: a DCP checkpoint (any layout) -> config.json + sharded
  model-*.safetensors + index + tokenizer, on CPU, reading each stored piece once (dcp_chunks.py).
- load.py: `[checkpoint] initial_load_in_hf = true`: each rank reads only its own slices.
- run_record.py: the run's model, recorded at launch in `{dump_folder}/mop_model.json`.

The GQA family has no export: its nearest HF architecture (Mixtral) has no routing bias, shared
expert or dense blocks, and rotates RoPE by halves (README, "Hugging Face").
"""
