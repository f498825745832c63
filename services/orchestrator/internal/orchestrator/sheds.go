package orchestrator

import (
	"context"
	"sync"
	"time"
)

// ShedCounter is where sheds are counted per tenant and minute (store.Operators).
type ShedCounter interface {
	AddSheds(ctx context.Context, tenant string, at time.Time, n int64) error
}

// shedCounts batches the runs shed per tenant for the store's usage figures (`curfew
// usage`): a shed storm costs one store write per tenant per flush, never one per shed,
// so counting sheds cannot add load when the orchestrator is already shedding it.
type shedCounts struct {
	mu sync.Mutex
	n  map[string]int64
}

func (c *shedCounts) add(tenant string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == nil {
		c.n = map[string]int64{}
	}
	c.n[tenant]++
}

func (c *shedCounts) take() map[string]int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := c.n
	c.n = nil
	return n
}

// ShedFlushPeriod is how often the sheds counted since the last flush are written.
const ShedFlushPeriod = 5 * time.Second

// FlushSheds writes the sheds counted since the last flush to the store, charged to the
// minute of now. Counts whose write fails are kept for the next flush. Call it every
// ShedFlushPeriod and once at shutdown.
func (s *Server) FlushSheds(now time.Time) {
	if s.cfg.Sheds == nil {
		return
	}
	for tenant, n := range s.sheds.take() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err := s.cfg.Sheds.AddSheds(ctx, tenant, now, n)
		cancel()
		if err != nil {
			s.cfg.Log.Warn("shed counts not written; kept for the next flush", "tenant", tenant, "sheds", n, "error", err.Error())
			s.sheds.mu.Lock()
			if s.sheds.n == nil {
				s.sheds.n = map[string]int64{}
			}
			s.sheds.n[tenant] += n
			s.sheds.mu.Unlock()
		}
	}
}
