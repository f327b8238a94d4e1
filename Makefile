# kvgate: build, run, test, lint, bench.
GO       ?= go
BIN      := bin/kvgate
PKGS     := ./...
STATICCHECK_VERSION := v0.8.2
STATICCHECK := $(shell $(GO) env GOPATH)/bin/staticcheck

# Version stamps for kvgate version and kvgate_build_info (cmd/kvgate/version.go).
VERSION  ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo "(devel)")
COMMIT   ?= $(shell c=$$(git rev-parse HEAD 2>/dev/null) && { git diff --quiet HEAD 2>/dev/null && echo $$c || echo $$c-dirty; } || echo unknown)
LDFLAGS  := -X main.stampVersion=$(VERSION) -X main.stampCommit=$(COMMIT)
# go-nvml's cgo bindings call NVML functions the header marks deprecated:
# gcc would print ~150 lines of warnings on the first build.
export CGO_CFLAGS ?= -O2 -g -Wno-deprecated-declarations

.PHONY: all build build-static run test experiments test-short fuzz fuzz-short node-deps lint fmt bench calibrate simcost clean docs

all: build

# With cgo (the default where gcc is installed) kvgate reads the GPUs
# through NVML; build-static is the CGO_ENABLED=0 binary of the container
# image, which reports NVML unavailable and needs no gcc.
build:
	$(GO) build -ldflags '$(LDFLAGS)' -o $(BIN) ./cmd/kvgate

build-static:
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '-s -w $(LDFLAGS)' -o $(BIN) ./cmd/kvgate

# kvgate on the embedded defaults: with no backend configured it fronts two
# simulated H100s in-process.
run: build
	$(BIN) serve --dev

# Every test under the race detector, then the long experiments on their
# own.
test: node-deps
	$(GO) test -race -count=1 $(PKGS)
	$(MAKE) -C deploy test
	$(MAKE) experiments

# Four experiments that measure throughput, preemption and waits, which
# the race detector's slowdown and parallel packages would distort: the
# overload, three-replica and fairness ones, and the job burst at its full
# 10,000 jobs (1,000 in the ordinary run). A plain go test skips them.
experiments:
	KVGATE_EXPERIMENTS=1 $(GO) test -count=1 -v -run '^(TestOverloadNoPreemption|TestJobBurst|TestThreeReplicasOneFleet|TestFairnessBurst)$$' ./gateway/

# The Files and Batch APIs' figures (docs/batches.md): the peak RSS growth
# of kvgate serve over a 200 MiB upload and download (goal: under 64 MiB)
# and its 50,000-line batch's acceptance, and a 50,000-line batch's
# acceptance on PostgreSQL in process. Both need the local PostgreSQL.
.PHONY: files-rss
files-rss:
	KVGATE_EXPERIMENTS=1 $(GO) test -count=1 -v -run '^TestFileRSS$$' ./cmd/kvgate/
	KVGATE_EXPERIMENTS=1 $(GO) test -count=1 -v -run '^TestBatchAcceptance50k$$' ./gateway/

# The OpenAI Node SDK for cmd/kvgate's TestOpenAINodeSDK, installed from the
# lockfile when it changed. Without node and npm the test skips (with
# CI=true it fails); an npm failure is fatal only with CI=true.
NODE_DIR := gateway/testdata/node
node-deps:
	@if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then \
		echo "node-deps: node or npm not found; TestOpenAINodeSDK will skip (fail with CI=true)"; \
	elif [ ! -f $(NODE_DIR)/node_modules/.package-lock.json ] || \
		[ $(NODE_DIR)/package-lock.json -nt $(NODE_DIR)/node_modules/.package-lock.json ]; then \
		echo "node-deps: npm ci in $(NODE_DIR)"; \
		(cd $(NODE_DIR) && npm ci --no-audit --no-fund) || { \
			echo "node-deps: npm ci failed"; [ "$$CI" != true ]; }; \
	fi

test-short:
	$(GO) test -count=1 -short $(PKGS)

# Each fuzz target for FUZZTIME in turn (go test -fuzz takes one target a
# run); a crasher lands in its package's testdata/fuzz/, to commit as a
# regression. Every go test runs the committed corpora without fuzzing.
# fuzz-short is CI's run: a count of inputs, not a duration, because
# go1.26's fuzzing coordinator can fail a run whose -fuzztime deadline
# lands while a worker is mid-input ("context deadline exceeded", no
# crasher; go.dev/issue/75804, fixed in Go 1.27), which a loaded CI host
# hits. A count has no deadline: a slow host only takes longer.
# FUZZFLAGS passes more, e.g. -parallel=2.
FUZZTIME ?= 30s
FUZZFLAGS ?=
FUZZ_TARGETS := \
	./gateway/:FuzzInferenceRequest \
	./gateway/:FuzzSubmitJob \
	./gateway/:FuzzSubmitJobPostgres \
	./gateway/:FuzzStreamRelay \
	./gpu/:FuzzParseEngineMetrics \
	./cmd/kvgate/:FuzzConfigLoad

fuzz:
	@set -e; for t in $(FUZZ_TARGETS); do \
		pkg=$${t%%:*}; name=$${t##*:}; \
		echo "fuzz: $$name ($$pkg) for $(FUZZTIME)"; \
		$(GO) test -run '^$$' -fuzz "^$$name\$$" -fuzztime $(FUZZTIME) -fuzzminimizetime 5s $(FUZZFLAGS) $$pkg; \
	done

fuzz-short:
	$(MAKE) fuzz FUZZTIME=2000x

$(STATICCHECK):
	$(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)

lint: $(STATICCHECK)
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)
	CGO_ENABLED=0 $(GO) build $(PKGS)
	$(STATICCHECK) $(PKGS)
	$(MAKE) -C deploy lint

fmt:
	gofmt -w $$(git ls-files '*.go')

# docs/configuration.md's reference, generated from cmd/kvgate/config.go
# (TestConfigReference fails while it is stale).
docs:
	KVGATE_UPDATE_DOCS=1 $(GO) test -count=1 -run '^TestConfigReference$$' ./cmd/kvgate/

# Go benchmarks, the gateway's overhead and throughput, the simulator's
# calibration table and CPU cost, then the named scenarios at a quarter of
# their size: kvgate, round-robin, an EPP-style threshold router and an
# llm-d-style prefix router, each in front of a fresh simulated fleet, on
# the same arrivals (shared-prefix and multi-turn included); reports in
# bin/bench/<scenario>/.
bench: build
	$(GO) test -run '^$$' -bench . -benchmem -count 5 ./bench/... ./gpu/ | tee bin/bench.txt
	$(GO) test -run '^$$' -bench 'GatewayOverhead' -benchtime 1x ./cmd/kvgate/ | tee -a bin/bench.txt
	$(GO) test -run '^$$' -bench 'GatewayThroughput' -benchtime 20000x -count 3 ./cmd/kvgate/ | tee -a bin/bench.txt
	$(BIN) sim calibrate
	$(BIN) sim cost
	$(BIN) bench scenario all --scale 0.25 --out bin/bench | tee bin/bench-scenarios.txt

calibrate: build
	$(BIN) sim calibrate

simcost: build
	$(BIN) sim cost

clean:
	rm -rf bin

# The chaos suite (bench/chaos, docs/chaos.md): scripted faults against
# real processes (kvgate serve, kvgate sim, nats-server and a private
# PostgreSQL cluster), each followed by the invariant checks over the
# store and the simulators' counters. chaos runs every scenario (about 6
# minutes: the cold start waits its full two minutes); chaos-short the
# subset CI runs (cold start after 25 s, one kill -9, SIGTERM with
# max_attempts 1: under two minutes). Logs of failed scenarios and the
# figures (figures.md) go to bin/chaos/.
# kvgate's durable path beside River on the same PostgreSQL, one run
# (bench/peers/river, a module of its own: River is no dependency of
# kvgate). PEERSFLAGS passes more, e.g. -rounds 7 -jobs 50000.
PEERSFLAGS ?=
.PHONY: bench-peers
bench-peers:
	cd bench/peers/river && $(GO) run . $(PEERSFLAGS)

.PHONY: chaos chaos-short
chaos:
	KVGATE_CHAOS=full KVGATE_CHAOS_DIR=$(CURDIR)/bin/chaos KVGATE_CHAOS_REPORT=$(CURDIR)/bin/chaos/figures.md \
		$(GO) test -count=1 -v -timeout 30m ./bench/chaos/

chaos-short:
	KVGATE_CHAOS=short KVGATE_CHAOS_DIR=$(CURDIR)/bin/chaos KVGATE_CHAOS_REPORT=$(CURDIR)/bin/chaos/figures-short.md \
		$(GO) test -count=1 -v -timeout 10m ./bench/chaos/
