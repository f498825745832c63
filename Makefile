# curfew's build and test entry points. Every target installs what it needs itself.
SHELL := /bin/bash
BIN   := $(CURDIR)/bin
SERVICES := orchestrator toolrunner subagent modelproxy
# VERSION is stamped into every binary (curfew version, curfew_build_info): the release tag
# when the commit has one, else the nearest tag with the commits since and a -dirty mark.
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
GOFLAGS_BUILD := -trimpath -ldflags "-X github.com/curfew-mesh/curfew/mesh/service.Version=$(VERSION)"

.PHONY: all build demo test test-short lint generate check-generated bench release clean

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

## release: record the API of VERSION=vX.Y.Z, commit and tag it (see scripts/release.sh)
release:
	bash scripts/release.sh $(VERSION)

clean:
	rm -rf $(BIN)
