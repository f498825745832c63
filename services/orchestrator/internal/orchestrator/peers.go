package orchestrator

import (
	"context"
	"time"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// While the store is down, an orchestrator that receives a CancelRun of a run it does not
// hold cannot read the run's owner from the store (cancelfwd.go). So each orchestrator on
// a shared store reads the owners of the runs in flight (store.Runs.RunOwners) every
// peerRefresh, and keeps each one it saw in the last peerMemory: its peers as of the
// store's last answers. Such a cancel is forwarded to each of them at once; the owner
// checks the caller's tenant itself and cancels the run, and the others answer that they
// cannot tell (UNAVAILABLE) or are gone.

// peerRefresh is how often the peers are read from the store. The query reads only the
// index of unfinished runs (runs_claimable), whatever the number of runs ended.
const peerRefresh = 2 * time.Second

// peerMemory is how long a peer is kept after the store last listed it: an orchestrator
// between two runs at one read is still one.
const peerMemory = time.Minute

// refreshPeers reads the peers now and every peerRefresh until ctx ends. A failed read
// keeps the peers known: that is when they are needed.
func (s *Server) refreshPeers(ctx context.Context) {
	t := time.NewTicker(peerRefresh)
	defer t.Stop()
	for {
		if owners, err := s.cfg.Store.RunOwners(ctx); err == nil {
			now := time.Now()
			s.mu.Lock()
			if s.peers == nil {
				s.peers = map[string]time.Time{}
			}
			for _, o := range owners {
				s.peers[o] = now
			}
			for o, seen := range s.peers {
				if now.Sub(seen) > peerMemory {
					delete(s.peers, o)
				}
			}
			s.mu.Unlock()
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// cancelAtPeers forwards req to every peer at once, and returns the first answer of one
// that held the run; false when none did (or none is known).
func (s *Server) cancelAtPeers(ctx context.Context, req *orchestratorv1.CancelRunRequest) (*orchestratorv1.Run, bool) {
	s.mu.Lock()
	var owners []string
	for o := range s.peers {
		if o != s.cfg.Owner && ownerAddr(o) != "" {
			owners = append(owners, o)
		}
	}
	s.mu.Unlock()
	if len(owners) == 0 {
		s.cfg.Log.InfoContext(ctx, "the store is down and no peer is known to send the cancel to", "run_id", req.GetRunId())
		return nil, false
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // the others' forwards, once one answered
	answers := make(chan *orchestratorv1.Run, len(owners))
	for _, o := range owners {
		go func() {
			r, ok := s.forwardCancel(ctx, store.Run{RunID: req.GetRunId(), Owner: o}, req)
			if !ok {
				r = nil
			}
			answers <- r
		}()
	}
	for range owners {
		if r := <-answers; r != nil {
			s.cfg.Log.InfoContext(ctx, "run cancelled through a peer while the store is down", "run_id", req.GetRunId())
			return r, true
		}
	}
	s.cfg.Log.InfoContext(ctx, "the store is down and no peer holds the run to cancel", "run_id", req.GetRunId(), "peers", owners)
	return nil, false
}
