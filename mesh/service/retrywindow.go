package service

import (
	"context"
	"fmt"

	"github.com/curfew-mesh/curfew/mesh/retrywindow"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// SharedSlots is a store whose slots other replicas may share (store.Store is one).
type SharedSlots interface {
	store.Slots
	store.Sharing
}

// CoordinateRetries coordinates the retries of every connection Dial makes from now on
// with the other replicas that share st (docs/cluster.md, "Coordinated retry windows"):
// per target, at most the retry file's window.replicas replicas retry at a time. It does
// nothing when st is not shared, or the file's window is off or --retry-coordination is
// off (then every replica retries on its own). Call it once, after New and before Dial. The window settings
// are read now: a reload of --retry-config does not change them. The windows held are
// released when Serve stops.
func (rt *Runtime) CoordinateRetries(st SharedSlots) error {
	if !st.Shared() {
		return nil
	}
	w := rt.retries.Load().RetryWindow()
	if w.Off {
		return nil
	}
	if rt.windows != nil {
		return fmt.Errorf("retry windows: CoordinateRetries called twice")
	}
	h, err := retrywindow.New(retrywindow.Config{Store: st, Window: w, Registerer: rt.Registry, Logger: rt.Log})
	if err != nil {
		return err
	}
	rt.windows = h
	rt.OnStop(func() {
		ctx, cancel := context.WithTimeout(context.Background(), retrywindow.StoreTimeout)
		defer cancel()
		if err := h.Close(ctx); err != nil {
			rt.Log.Warn("releasing the retry windows", "error", err.Error())
		}
	})
	rt.Log.Info("retries coordinated across replicas", "window_replicas", w.Replicas, "window_length", w.Length.String(),
		"holder", h.Name())
	return nil
}

// RetryWindows returns the holder of the coordinated retry windows, or nil when
// CoordinateRetries did not coordinate them (every replica retries on its own).
func (rt *Runtime) RetryWindows() *retrywindow.Holder { return rt.windows }
