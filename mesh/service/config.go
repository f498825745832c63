package service

import (
	"context"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/curfew-mesh/curfew/mesh/configwatch"
	"github.com/curfew-mesh/curfew/mesh/decoderlease"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// ReplicaRefresh is how often a service rewrites its rows of store.Replicas, so that a
// replica whose rows are older than a few periods is gone.
const ReplicaRefresh = 15 * time.Second

// ReplicaForget is how long rows of store.Replicas are kept after their replica last
// wrote them: long enough for an operator to see a replica that just died.
const ReplicaForget = 24 * time.Hour

// configs are a runtime's live configuration files (package configwatch): their metrics,
// their statuses, and the store rows that record them.
type configs struct {
	metrics *configwatch.Metrics

	mu       sync.Mutex
	statuses []func() configwatch.Status
	kick     chan struct{} // a reload happened: rewrite the rows now
}

// WatchConfig keeps the file cfg names live for rt's service: loaded now (an error is
// the caller's to report: a bad file at start stops the service), then reloaded when it
// changes and on SIGHUP until the service stops, with curfew_config_reload_failures_total
// and the store rows of RecordConfigs. Apply is cfg's swap into the running service.
func WatchConfig[T any](ctx context.Context, rt *Runtime, cfg configwatch.Config[T]) (*configwatch.Watcher[T], error) {
	next := cfg.OnReload
	cfg.OnReload = func(s configwatch.Status) {
		if next != nil {
			next(s)
		}
		select {
		case rt.configs.kick <- struct{}{}:
		default:
		}
	}
	w, err := configwatch.New(cfg, rt.configs.metrics, rt.Log)
	if err != nil {
		return nil, err
	}
	rt.configs.mu.Lock()
	rt.configs.statuses = append(rt.configs.statuses, w.Status)
	rt.configs.mu.Unlock()
	w.Start(ctx)
	rt.OnStop(w.Close)
	return w, nil
}

// ConfigStatuses reports every live configuration file of the service: its version,
// when it was loaded, and why its last reload failed, if it did.
func (rt *Runtime) ConfigStatuses() []configwatch.Status {
	rt.configs.mu.Lock()
	fns := append([]func() configwatch.Status(nil), rt.configs.statuses...)
	rt.configs.mu.Unlock()
	out := make([]configwatch.Status, len(fns))
	for i, f := range fns {
		out[i] = f()
	}
	return out
}

// Replica names this replica in store.Replicas: its host and gRPC listen address, so
// that replicas on one host differ and a restarted pod keeps its rows.
func (rt *Runtime) Replica() string {
	host, _ := os.Hostname()
	return fmt.Sprintf("%s/%s", host, rt.Addr())
}

// RecordConfigs writes the service's configuration versions to st (one row per live
// file, as Replica) now, after each reload, and every ReplicaRefresh until ctx ends, and
// forgets rows not written for ReplicaForget. Write failures are logged; the service
// goes on. It returns at once.
func (rt *Runtime) RecordConfigs(ctx context.Context, st store.Replicas) {
	replica := rt.Replica()
	write := func() {
		wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		for _, s := range rt.ConfigStatuses() {
			err := st.PutReplicaConfig(wctx, store.ReplicaConfig{Service: rt.Opts.Name, Replica: replica, Config: s.Name,
				Version: s.Version, LoadedAt: s.LoadedAt, LastError: s.LastError, LastErrorAt: s.LastErrorAt})
			if err != nil && ctx.Err() == nil {
				rt.Log.Warn("recording the configuration version in the store", "config", s.Name, "error", err.Error())
			}
		}
	}
	write()
	go func() {
		t := time.NewTicker(ReplicaRefresh)
		defer t.Stop()
		pruned := time.Time{}
		for {
			select {
			case <-ctx.Done():
				return
			case <-rt.configs.kick:
				write()
			case now := <-t.C:
				write()
				if now.Sub(pruned) >= time.Hour {
					pruned = now
					pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
					if _, err := st.PruneReplicaConfigs(pctx, now.Add(-ReplicaForget)); err != nil && ctx.Err() == nil {
						rt.Log.Warn("forgetting old replicas' configuration rows", "error", err.Error())
					}
					cancel()
				}
			}
		}
	}()
}

// WatchDecoder keeps the decoder-lease timing of leases (heartbeat and TTL) live from the
// decoder configuration file at path (--decoder-config, decoderlease.DecodeTiming),
// applying the file's timing now.
func WatchDecoder(ctx context.Context, rt *Runtime, path string, leases *decoderlease.Keeper) error {
	w, err := WatchConfig(ctx, rt, configwatch.Config[decoderlease.Timing]{Name: "decoder", Path: path,
		Load:  decoderlease.DecodeTiming,
		Apply: func(t decoderlease.Timing) error { return leases.SetTiming(t.Heartbeat, t.LeaseTTL) }})
	if err != nil {
		return err
	}
	t := w.Current()
	return leases.SetTiming(t.Heartbeat, t.LeaseTTL)
}

// LiveReplicas counts the replicas of service whose rows in st (RecordConfigs) were
// written in the last three ReplicaRefresh periods, self always included: the replica
// count of a cluster-wide limit's local share while the store is down. A replica
// writes rows only for its configuration files, so one run without any is counted only
// by itself.
func LiveReplicas(ctx context.Context, st store.Replicas, service, self string) (int, error) {
	cs, err := st.ListReplicaConfigs(ctx, service)
	if err != nil {
		return 0, err
	}
	seen := map[string]bool{self: true}
	for _, c := range cs {
		if time.Since(c.SeenAt) < 3*ReplicaRefresh {
			seen[c.Replica] = true
		}
	}
	return len(seen), nil
}
