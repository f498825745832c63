package openaiapi

import (
	"testing"
	"time"
)

// A keyed run whose last request left is cancelled after the grace; a request that
// attaches within it stops the timer, and one that leaves while another is attached
// starts none.
func TestAttachedGrace(t *testing.T) {
	var a attached
	cancelled := make(chan string, 4)
	cancel := func(run string) func() { return func() { cancelled <- run } }

	// Abandoned, nobody comes back: cancelled after the grace.
	a.attach("r1")
	a.detach("r1", true, time.Millisecond, cancel("r1"))
	select {
	case run := <-cancelled:
		if run != "r1" {
			t.Fatalf("cancelled %s, want r1", run)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the abandoned run was not cancelled after its grace")
	}

	// Abandoned, then a retry attaches within the (long) grace: no timer is left, and
	// the retry's ordinary end cancels nothing.
	a.attach("r2")
	a.detach("r2", true, time.Hour, cancel("r2"))
	if w := a.runs["r2"]; w == nil || w.grace == nil {
		t.Fatal("no grace timer after the last request left")
	}
	a.attach("r2")
	if w := a.runs["r2"]; w.grace != nil || w.n != 1 {
		t.Fatalf("after the retry attached: %+v, want one attached and no timer", w)
	}
	a.detach("r2", false, time.Hour, cancel("r2"))
	if _, ok := a.runs["r2"]; ok {
		t.Error("a run whose request ended with it is still tracked")
	}

	// Two attached, one leaves: the other still holds the run.
	a.attach("r3")
	a.attach("r3")
	a.detach("r3", true, time.Millisecond, cancel("r3"))
	if w := a.runs["r3"]; w.grace != nil || w.n != 1 {
		t.Fatalf("one of two left: %+v, want one attached and no timer", w)
	}
	select {
	case run := <-cancelled:
		t.Fatalf("cancelled %s while a request was attached", run)
	default:
	}
}
