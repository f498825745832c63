package soak

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"

	"github.com/curfew-mesh/curfew/internal/mcptest"
)

// EffectsFromRecord counts the effects of the MCP test server's effect tool from the
// calls it recorded (curfew-mcptest --record path): a logical call is a run's tool node,
// and its effect happened more than once when the server saw it under more than one
// idempotency key (the server does the effect once per key, so retries under one key
// are not duplicates).
func EffectsFromRecord(path string) (Effects, error) {
	f, err := os.Open(path) //nolint:gosec // the record file the caller named
	if err != nil {
		return Effects{}, err
	}
	defer func() { _ = f.Close() }()
	keys := map[string]map[string]bool{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var r mcptest.Record
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			return Effects{}, fmt.Errorf("%s: %w", path, err)
		}
		if r.Tool != "effect" || r.Meta.IdempotencyKey == "" {
			continue
		}
		call := r.Meta.RunID + " " + r.Meta.NodeID
		if keys[call] == nil {
			keys[call] = map[string]bool{}
		}
		keys[call][r.Meta.IdempotencyKey] = true
	}
	if err := sc.Err(); err != nil {
		return Effects{}, err
	}
	e := Effects{Calls: len(keys)}
	for _, ks := range keys {
		if len(ks) > 1 {
			e.Duplicates++
		}
	}
	return e, nil
}
