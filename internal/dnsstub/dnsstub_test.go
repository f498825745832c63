package dnsstub_test

import (
	"context"
	"net"
	"slices"
	"testing"

	"go.uber.org/goleak"

	"github.com/curfew-mesh/curfew/internal/dnsstub"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// resolver asks only s.
func resolver(s *dnsstub.Server) *net.Resolver {
	return &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return new(net.Dialer).DialContext(ctx, "udp", s.Addr())
	}}
}

func TestAnswersEveryAddressOfAName(t *testing.T) {
	s, err := dnsstub.Start(t.Context(), map[string][]string{"toolrunner.curfew.test": {"127.0.0.1", "127.0.0.2"}})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = s.Close() }()
	got, err := resolver(s).LookupHost(t.Context(), "toolrunner.curfew.test")
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(got)
	if !slices.Equal(got, []string{"127.0.0.1", "127.0.0.2"}) {
		t.Fatalf("toolrunner.curfew.test resolved to %v, want both replicas", got)
	}
	if _, err := resolver(s).LookupHost(t.Context(), "other.curfew.test"); err == nil {
		t.Fatal("an unknown name resolved; want NXDOMAIN")
	}
}

func TestRefusesWhatIsNotAnIPv4Address(t *testing.T) {
	if _, err := dnsstub.Start(t.Context(), map[string][]string{"a.test": {"::1"}}); err == nil {
		t.Fatal("Start took an IPv6 address for an A record")
	}
}

func ExampleServer_Target() {
	s, err := dnsstub.Start(context.Background(), map[string][]string{"modelproxy.curfew.test": {"127.0.0.1", "127.0.0.2"}})
	if err != nil {
		panic(err)
	}
	defer func() { _ = s.Close() }()
	_ = s.Target("modelproxy.curfew.test", 7001) // dns://127.0.0.1:<port>/modelproxy.curfew.test:7001, a --modelproxy flag's value
}
