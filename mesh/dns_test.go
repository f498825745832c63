package mesh_test

import (
	"context"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/dns/dnsmessage"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/curfew-mesh/curfew/mesh"
)

// dnsServer answers A queries for every name with its current addresses (a headless
// Service's answer as the pods behind it change) and everything else with no records.
type dnsServer struct {
	conn  net.PacketConn
	mu    sync.Mutex
	addrs []net.IP
	done  chan struct{}
}

func startDNS(t *testing.T, addrs ...net.IP) *dnsServer {
	t.Helper()
	conn, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &dnsServer{conn: conn, addrs: addrs, done: make(chan struct{})}
	go s.serve()
	t.Cleanup(func() {
		_ = conn.Close()
		<-s.done
	})
	return s
}

func (s *dnsServer) set(addrs ...net.IP) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.addrs = addrs
}

func (s *dnsServer) serve() {
	defer close(s.done)
	buf := make([]byte, 512)
	for {
		n, from, err := s.conn.ReadFrom(buf)
		if err != nil {
			return
		}
		var p dnsmessage.Parser
		h, err := p.Start(buf[:n])
		if err != nil {
			continue
		}
		q, err := p.Question()
		if err != nil {
			continue
		}
		b := dnsmessage.NewBuilder(nil, dnsmessage.Header{ID: h.ID, Response: true, Authoritative: true})
		_ = b.StartQuestions()
		_ = b.Question(q)
		_ = b.StartAnswers()
		if q.Type == dnsmessage.TypeA {
			s.mu.Lock()
			for _, ip := range s.addrs {
				var a [4]byte
				copy(a[:], ip.To4())
				_ = b.AResource(dnsmessage.ResourceHeader{Name: q.Name, Class: dnsmessage.ClassINET, TTL: 0}, dnsmessage.AResource{A: a})
			}
			s.mu.Unlock()
		}
		msg, err := b.Finish()
		if err == nil {
			_, _ = s.conn.WriteTo(msg, from)
		}
	}
}

// serveHealth serves grpc.health.v1 on addr until the test ends or stop is called.
func serveHealth(t *testing.T, addr string) (stop func()) {
	t.Helper()
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	healthpb.RegisterHealthServer(srv, health.NewServer())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(lis)
	}()
	stop = sync.OnceFunc(func() {
		srv.Stop()
		<-done
	})
	t.Cleanup(stop)
	return stop
}

// A connection whose every address was replaced (a rolling update of a headless Service's
// pods) finds the new ones within a few seconds of its first failed call: DNSReresolveInterval,
// not grpc-go's 30 s, bounds how long it keeps the dead answer.
func TestConnectionsReresolveAfterTheirAddressesAreReplaced(t *testing.T) {
	oldIP, newIP := net.ParseIP("127.0.0.2"), net.ParseIP("127.0.0.3")
	probe, err := net.Listen("tcp", oldIP.String()+":0")
	if err != nil {
		t.Skipf("no 127.0.0.2 on this machine: %v", err)
	}
	port := strconv.Itoa(probe.Addr().(*net.TCPAddr).Port)
	_ = probe.Close()

	dns := startDNS(t, oldIP)
	stopOld := serveHealth(t, net.JoinHostPort(oldIP.String(), port))
	conn, err := grpc.NewClient("dns://"+dns.conn.LocalAddr().String()+"/backends.curfew.test:"+port,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultServiceConfig(mesh.LoadBalancingConfig))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := healthpb.NewHealthClient(conn)
	check := func() error {
		ctx, cancel := context.WithTimeout(t.Context(), time.Second)
		defer cancel()
		_, err := client.Check(ctx, &healthpb.HealthCheckRequest{})
		return err
	}
	if err := check(); err != nil {
		t.Fatalf("before the replacement: %v", err)
	}

	// The old pod goes, the new one answers, DNS says so.
	stopOld()
	serveHealth(t, net.JoinHostPort(newIP.String(), port))
	dns.set(newIP)

	// Bound: a few re-resolution intervals, far below grpc-go's default of 30 s.
	bound := 5 * mesh.DNSReresolveInterval
	start := time.Now()
	var last error
	for time.Since(start) < bound {
		if last = check(); last == nil {
			t.Logf("calls reached the new address %s after the old one went", time.Since(start).Round(10*time.Millisecond))
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("calls still fail %s after the addresses were replaced: %v", bound, last)
}

// A connection whose only address went away for 30 s reaches it again within
// ReconnectMaxDelay (and a little) of its return: its attempts are at most that far apart.
// grpc-go's default backoff would have spaced them 10-20 s apart by then.
func TestConnectionsReconnectSoonAfterALongOutage(t *testing.T) {
	if testing.Short() {
		t.Skip("waits out a 30 s outage")
	}
	t.Parallel()
	probe, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := probe.Addr().String()
	_ = probe.Close()
	stop := serveHealth(t, addr)
	conn, err := grpc.NewClient(addr, append(mesh.DialOptions(mesh.ClientConfig{}), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := healthpb.NewHealthClient(conn)
	if _, err := client.Check(t.Context(), &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatalf("before the outage: %v", err)
	}

	stop()
	const outage = 30 * time.Second
	time.Sleep(outage)
	serveHealth(t, addr)
	back := time.Now()
	ctx, cancel := context.WithTimeout(t.Context(), 40*time.Second)
	defer cancel()
	if _, err := client.Check(ctx, &healthpb.HealthCheckRequest{}, grpc.WaitForReady(true)); err != nil {
		t.Fatalf("after the outage: %v", err)
	}
	took := time.Since(back)
	t.Logf("reached again %v after a %v outage ended", took.Round(10*time.Millisecond), outage)
	// The last attempt before the return was at most ReconnectMaxDelay (+20 % jitter)
	// before the next; 2 s of margin for a loaded machine.
	if bound := mesh.ReconnectMaxDelay*6/5 + 2*time.Second; took > bound {
		t.Fatalf("reached again %v after the outage ended, want ≤ %v", took.Round(10*time.Millisecond), bound)
	}
}
