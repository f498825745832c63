package retrywindow

import (
	"context"
	"errors"
	"io"
	"net"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

// proxy forwards TCP connections from its address to target until cut, which closes
// its listener and every connection (the store is unreachable: connections refused),
// and restore listens again on the same address.
type proxy struct {
	t      *testing.T
	addr   string
	target string

	mu    sync.Mutex
	lis   net.Listener
	conns []net.Conn
	wg    sync.WaitGroup
}

func newProxy(t *testing.T, target string) *proxy {
	p := &proxy{t: t, target: target}
	p.listen("127.0.0.1:0")
	t.Cleanup(p.cut)
	return p
}

func (p *proxy) listen(addr string) {
	var lc net.ListenConfig
	lis, err := lc.Listen(context.Background(), "tcp", addr)
	if err != nil {
		p.t.Fatal(err)
	}
	p.mu.Lock()
	p.lis, p.addr = lis, lis.Addr().String()
	p.mu.Unlock()
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			var d net.Dialer
			up, err := d.DialContext(context.Background(), "tcp", p.target)
			if err != nil {
				_ = c.Close()
				continue
			}
			p.mu.Lock()
			p.conns = append(p.conns, c, up)
			p.mu.Unlock()
			p.wg.Add(2)
			go func() { defer p.wg.Done(); _, _ = io.Copy(up, c); _ = up.Close() }()
			go func() { defer p.wg.Done(); _, _ = io.Copy(c, up); _ = c.Close() }()
		}
	}()
}

func (p *proxy) cut() {
	p.mu.Lock()
	if p.lis != nil {
		_ = p.lis.Close()
		p.lis = nil
	}
	for _, c := range p.conns {
		_ = c.Close()
	}
	p.conns = nil
	p.mu.Unlock()
	p.wg.Wait()
}

func (p *proxy) restore() { p.listen(p.addr) }

// TestPostgresOutage: PostgreSQL becomes unreachable mid-load (every connection cut,
// new ones refused). Within a verification period the window held ends, and from then
// on no replica is allowed a retry: they are refused at once, without waiting on the
// store. When PostgreSQL is reachable again, coordination resumes: one replica claims
// the window, the other is refused.
func TestPostgresOutage(t *testing.T) {
	dsn := storetest.PostgresDSN(t)
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	px := newProxy(t, u.Host)
	u.Host = px.addr
	length := 1500 * time.Millisecond
	var hs []*Holder
	for _, name := range []string{"a", "b"} {
		st, err := store.Open(context.Background(), u.String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = st.Close() })
		hs = append(hs, newHolder(t, st, name, 1, length, nil))
	}
	a, b := hs[0], hs[1]
	if err := a.AllowRetry(context.Background(), "toolrunner"); err != nil {
		t.Fatal(err)
	}
	if err := b.AllowRetry(context.Background(), "toolrunner"); !errors.Is(err, ErrBusy) {
		t.Fatalf("b: %v", err)
	}

	px.cut()
	cut := time.Now()
	// a's window ends at its next verification, at most length/3 from its claim.
	for _, h := range hs {
		for time.Since(cut) < a.verify+StoreTimeout {
			if err := h.AllowRetry(context.Background(), "toolrunner"); err != nil {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	if a.Status()["toolrunner"].Held {
		t.Fatalf("a still holds its window %v after the store became unreachable", time.Since(cut))
	}
	// The outage goes on: every retry is refused, each decision quick.
	var slowest time.Duration
	for end := time.Now().Add(2 * time.Second); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
		for _, h := range hs {
			start := time.Now()
			err := h.AllowRetry(context.Background(), "toolrunner")
			slowest = max(slowest, time.Since(start))
			if err == nil {
				t.Fatalf("%s allowed a retry with the store unreachable", h.Name())
			}
			if !errors.Is(err, ErrStoreDown) && !errors.Is(err, ErrBusy) {
				t.Fatalf("%s: %v", h.Name(), err)
			}
		}
	}
	if slowest > StoreTimeout+250*time.Millisecond {
		t.Fatalf("a refusal took %v with the store down, more than its bound", slowest)
	}
	if v := testutil.ToFloat64(a.metrics.refusedC.WithLabelValues("toolrunner", "store_down")); v == 0 {
		t.Fatal("no refusal counted as store_down")
	}
	if v := testutil.ToFloat64(a.metrics.lostC.WithLabelValues("toolrunner", "verify_failed")); v != 1 {
		t.Fatalf("a's window lost %v times for verify_failed, want 1", v)
	}

	px.restore()
	restored := time.Now()
	var holder *Holder
	for holder == nil {
		for _, h := range hs {
			if h.AllowRetry(context.Background(), "toolrunner") == nil {
				holder = h
				break
			}
		}
		if time.Since(restored) > 10*time.Second {
			t.Fatal("coordination did not resume within 10 s of the store's return")
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("store unreachable for %v, slowest refusal %v; %s claimed the window %v after the store came back",
		restored.Sub(cut).Round(time.Millisecond), slowest.Round(time.Millisecond), holder.Name(), time.Since(restored).Round(time.Millisecond))
	other := a
	if holder == a {
		other = b
	}
	for end := time.Now().Add(3 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		err := other.AllowRetry(context.Background(), "toolrunner")
		if err == nil && holder.Status()["toolrunner"].Held {
			t.Fatalf("both %s and %s hold a window", holder.Name(), other.Name())
		}
		if errors.Is(err, ErrBusy) {
			break
		}
		if time.Now().After(end) {
			t.Fatalf("%s after the store came back: %v, want ErrBusy", other.Name(), err)
		}
	}
}
