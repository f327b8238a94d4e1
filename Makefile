# kvgate: build, run, test, lint, bench.
GO       ?= go
BIN      := bin/kvgate
PKGS     := ./...
STATICCHECK_VERSION := v0.8.2
STATICCHECK := $(shell $(GO) env GOPATH)/bin/staticcheck

.PHONY: all build run test test-short lint fmt bench calibrate simcost clean

all: build

build:
	$(GO) build -o $(BIN) ./cmd/kvgate

# Until the gateway lands, `make run` starts one simulated H100 on :8000.
run: build
	$(BIN) sim --profile h100-llama-3.1-8b --port 8000

test:
	$(GO) test -race -count=1 $(PKGS)

test-short:
	$(GO) test -count=1 -short $(PKGS)

$(STATICCHECK):
	$(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)

lint: $(STATICCHECK)
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)
	$(STATICCHECK) $(PKGS)

fmt:
	gofmt -w $$(git ls-files '*.go')

# Go benchmarks, then the simulator's calibration table and CPU cost.
bench: build
	$(GO) test -run '^$$' -bench . -benchmem -count 5 ./bench/... | tee bin/bench.txt
	$(BIN) sim calibrate
	$(BIN) sim cost

calibrate: build
	$(BIN) sim calibrate

simcost: build
	$(BIN) sim cost

clean:
	rm -rf bin
