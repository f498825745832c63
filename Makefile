# curfew's build and test entry points. Every target installs what it needs itself.
SHELL := /bin/bash
BIN   := $(CURDIR)/bin
SERVICES := orchestrator toolrunner subagent modelproxy
GOFLAGS_BUILD := -trimpath

.PHONY: all build demo test test-short lint generate check-generated bench clean

all: build

## build: the curfew CLI and the four service binaries, into ./bin
build:
	@mkdir -p $(BIN)
	go build $(GOFLAGS_BUILD) -o $(BIN)/curfew ./cmd/curfew
	@for s in $(SERVICES); do (cd services/$$s && go build $(GOFLAGS_BUILD) -o $(BIN)/$$s ./cmd/$$s) || exit 1; done

## demo: start the mesh, run the demo plan, disconnect at 3.5 s, show the frozen tokens
demo: build
	bash scripts/demo.sh

## test: the whole suite (unit, race, goroutine leaks, end-to-end on real processes)
test:
	bash scripts/test.sh

## generate: regenerate gen/ from proto/
generate:
	bash scripts/generate.sh

## check-generated: fail if gen/ differs from what proto/ generates
check-generated:
	bash scripts/generate.sh --check

## lint: gofmt, go vet, buf lint, golangci-lint
lint:
	bash scripts/lint.sh

## bench: the benchmarks recorded in docs/benchmarks.md
bench: build
	bash scripts/bench.sh

clean:
	rm -rf $(BIN)
