package orchestrator

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"testing"
	"time"
)

type countedSheds struct {
	fail bool
	got  map[string]int64
}

func (c *countedSheds) AddSheds(_ context.Context, tenant string, _ time.Time, n int64) error {
	if c.fail {
		return errors.New("store down")
	}
	if c.got == nil {
		c.got = map[string]int64{}
	}
	c.got[tenant] += n
	return nil
}

// Sheds are written in one batch per tenant, and a failed write loses none of them.
func TestFlushShedsKeepsWhatFailed(t *testing.T) {
	c := &countedSheds{fail: true}
	s := &Server{cfg: Config{Sheds: c, Log: slog.New(slog.NewTextHandler(io.Discard, nil))}}
	for range 3 {
		s.sheds.add("acme")
	}
	s.sheds.add("beta")
	s.FlushSheds(time.Now())
	s.sheds.add("acme")
	c.fail = false
	s.FlushSheds(time.Now())
	if c.got["acme"] != 4 || c.got["beta"] != 1 {
		t.Fatalf("written %v, want acme 4 and beta 1", c.got)
	}
	s.FlushSheds(time.Now())
	if c.got["acme"] != 4 {
		t.Fatalf("a flush with nothing new wrote again: %v", c.got)
	}
}
