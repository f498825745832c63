package service_test

import (
	"context"
	"errors"
	"flag"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"

	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh/breaker"
	"github.com/curfew-mesh/curfew/mesh/service"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func env(kv map[string]string) func(string) string { return func(k string) string { return kv[k] } }

func newFlags() (*flag.FlagSet, *service.Options) {
	fs := flag.NewFlagSet("svc", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	o := &service.Options{}
	o.Register(fs, "svc", "127.0.0.1:7000", "127.0.0.1:7001")
	return fs, o
}

func TestParsePrecedence(t *testing.T) {
	fs, o := newFlags()
	err := service.Parse(fs, []string{"--addr", "127.0.0.1:9000", "--log-level=warn", "--insecure"}, env(map[string]string{
		"CURFEW_ADDR":             "127.0.0.1:9999", // the flag wins
		"CURFEW_SHUTDOWN_GRACE":   "3s",             // env fills a flag not given
		"CURFEW_LOG_LEVEL":        "nonsense",       // ignored: the flag was given
		"CURFEW_DEFAULT_DEADLINE": "",               // empty means unset
		"CURFEW_DRAIN_DELAY":      "4s",
	}))
	if err != nil {
		t.Fatal(err)
	}
	if o.Name != "svc" || o.Addr != "127.0.0.1:9000" || o.ShutdownGrace != 3*time.Second || o.LogLevel != "warn" {
		t.Errorf("options = %+v", o)
	}
	if o.DrainDelay != 4*time.Second || o.StopBound() != 4*time.Second+3*time.Second+service.StopFlush {
		t.Errorf("drain delay %v, bound %v", o.DrainDelay, o.StopBound())
	}
	if o.AdminAddr != "127.0.0.1:7001" || o.DefaultDeadline != 30*time.Second || o.MaxDeadline != 10*time.Minute {
		t.Errorf("defaults not kept: %+v", o)
	}
	if err := o.Validate(); err != nil {
		t.Errorf("parsed options invalid: %v", err)
	}
}

func TestParseBadEnvNamesTheVariable(t *testing.T) {
	fs, _ := newFlags()
	err := service.Parse(fs, nil, env(map[string]string{"CURFEW_MAX_DEADLINE": "forever", "CURFEW_SHUTDOWN_GRACE": "x"}))
	if err == nil {
		t.Fatal("no error for bad env values")
	}
	for _, want := range []string{`CURFEW_MAX_DEADLINE="forever"`, "--max-deadline", `CURFEW_SHUTDOWN_GRACE="x"`, "--shutdown-grace"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not name %s", err, want)
		}
	}
}

func TestParseErrors(t *testing.T) {
	fs, _ := newFlags()
	if err := service.Parse(fs, []string{"--addr", "x", "extra"}, env(nil)); err == nil || !strings.Contains(err.Error(), "unexpected arguments: extra") {
		t.Errorf("stray argument: %v", err)
	}
	fs, _ = newFlags()
	if err := service.Parse(fs, []string{"--max-deadline", "soon"}, env(nil)); err == nil {
		t.Error("bad flag value accepted")
	}
}

func TestEnvName(t *testing.T) {
	for in, want := range map[string]string{"addr": "CURFEW_ADDR", "admin-addr": "CURFEW_ADMIN_ADDR", "foo-bar-baz": "CURFEW_FOO_BAR_BAZ"} {
		if got := service.EnvName(in); got != want {
			t.Errorf("EnvName(%q) = %q, want %q", in, got, want)
		}
	}
}

func validOptions() service.Options {
	return service.Options{Name: "test", Addr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", ShutdownGrace: time.Second,
		DefaultDeadline: time.Second, MaxDeadline: time.Minute, LogLevel: "error", Insecure: true}
}

func TestOptionsValidate(t *testing.T) {
	cases := []struct {
		name string
		mod  func(*service.Options)
		want string
	}{
		{"valid", func(*service.Options) {}, ""},
		{"no addr", func(o *service.Options) { o.Addr = "" }, "--addr"},
		{"zero grace", func(o *service.Options) { o.ShutdownGrace = 0 }, "--shutdown-grace"},
		{"negative drain delay", func(o *service.Options) { o.DrainDelay = -time.Second }, "--drain-delay must not be negative"},
		{"drain delay", func(o *service.Options) { o.DrainDelay = 5 * time.Second }, ""},
		{"zero default", func(o *service.Options) { o.DefaultDeadline = 0 }, "--default-deadline"},
		{"negative max", func(o *service.Options) { o.MaxDeadline = -time.Second }, "--max-deadline"},
		{"default above max", func(o *service.Options) { o.DefaultDeadline = 2 * time.Minute }, "exceeds --max-deadline"},
		{"bad level", func(o *service.Options) { o.LogLevel = "loud" }, "--log-level"},
	}
	for _, tc := range cases {
		o := validOptions()
		tc.mod(&o)
		err := o.Validate()
		if (tc.want == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("%s: Validate = %v, want error containing %q", tc.name, err, tc.want)
		}
	}
	o := validOptions()
	o.Addr = ""
	if _, err := service.New(context.Background(), o, nil); err == nil {
		t.Error("New accepted invalid options")
	}
}

func TestNewReportsBusyAddress(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	o := validOptions()
	o.Addr = lis.Addr().String()
	if _, err := service.New(context.Background(), o, nil); err == nil || !strings.Contains(err.Error(), "--addr") {
		t.Errorf("New on a busy --addr: %v", err)
	}
	o = validOptions()
	o.AdminAddr = lis.Addr().String()
	if _, err := service.New(context.Background(), o, nil); err == nil || !strings.Contains(err.Error(), "--admin-addr") {
		t.Errorf("New on a busy --admin-addr: %v", err)
	}
}

// hang is a ToolRunnerService whose Execute never returns until its context is
// cancelled.
type hang struct {
	toolrunnerv1.UnimplementedToolRunnerServiceServer
	started   chan struct{}
	cancelled atomic.Bool
}

func (h *hang) Execute(_ *toolrunnerv1.ExecuteRequest, ss grpc.ServerStreamingServer[toolrunnerv1.ExecuteResponse]) error {
	close(h.started)
	<-ss.Context().Done()
	h.cancelled.Store(true)
	return ss.Context().Err()
}

type running struct {
	rt    *service.Runtime
	cc    *grpc.ClientConn
	stop  context.CancelFunc
	done  chan error
	admin string
}

func start(t *testing.T, o service.Options, register func(*grpc.Server)) *running {
	t.Helper()
	return startHooked(t, o, register, nil)
}

// With --pprof the admin address serves the runtime's profiles; a heap profile with
// ?gc=1 collects first (the soak's heap after a forced collection).
func TestRuntimeServesProfilesWithPprof(t *testing.T) {
	o := validOptions()
	o.Pprof = true
	r := start(t, o, nil)
	for _, path := range []string{"/debug/pprof/", "/debug/pprof/heap?gc=1", "/debug/pprof/goroutine?debug=1", "/debug/pprof/profile?seconds=1"} {
		if code, body := get(t, r.admin+path); code != http.StatusOK || body == "" {
			t.Errorf("%s = %d, %d bytes; want 200 and a profile", path, code, len(body))
		}
	}
}

var httpClient = &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 3 * time.Second}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := httpClient.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func TestRuntimeServesHealthAdminAndReflection(t *testing.T) {
	r := start(t, validOptions(), nil)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()

	watch, err := healthpb.NewHealthClient(r.cc).Watch(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if m, err := watch.Recv(); err != nil || m.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health = %v, %v; want SERVING", m, err)
	}

	if code, body := get(t, r.admin+"/healthz"); code != http.StatusOK || body != "ok\n" {
		t.Errorf("/healthz = %d %q", code, body)
	}
	if code, _ := get(t, r.admin+"/readyz"); code != http.StatusOK {
		t.Errorf("/readyz while serving = %d", code)
	}
	if code, body := get(t, r.admin+"/metrics"); code != http.StatusOK || !strings.Contains(body, "go_goroutines") {
		t.Errorf("/metrics = %d, has go_goroutines: %v", code, strings.Contains(body, "go_goroutines"))
	}
	if code, _ := get(t, r.admin+"/debug/pprof/heap"); code != http.StatusNotFound {
		t.Errorf("/debug/pprof/heap without --pprof = %d, want 404", code)
	}

	refl, err := reflectionpb.NewServerReflectionClient(r.cc).ServerReflectionInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := refl.Send(&reflectionpb.ServerReflectionRequest{MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{}}); err != nil {
		t.Fatal(err)
	}
	resp, err := refl.Recv()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, s := range resp.GetListServicesResponse().GetService() {
		names = append(names, s.GetName())
	}
	if !strings.Contains(strings.Join(names, ","), "grpc.health.v1.Health") {
		t.Errorf("reflection lists %v, want grpc.health.v1.Health", names)
	}
	_ = refl.CloseSend()
	if _, err := refl.Recv(); !errors.Is(err, io.EOF) {
		t.Errorf("reflection stream end: %v", err)
	}

	// Stopping turns health NOT_SERVING for those still watching.
	r.stop()
	if m, err := watch.Recv(); err != nil || m.GetStatus() != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Fatalf("health after stop = %v, %v; want NOT_SERVING", m, err)
	}
	cancel() // the watch was the last call in flight: the graceful stop completes
	select {
	case err := <-r.done:
		if err != nil {
			t.Errorf("Serve = %v, want nil after a clean stop", err)
		}
		r.done <- nil // for the cleanup
	case <-time.After(3 * time.Second):
		t.Fatal("Serve did not return once the last call ended")
	}
	if resp, err := httpClient.Get(r.admin + "/healthz"); err == nil {
		_ = resp.Body.Close()
		t.Error("admin port still serving after Serve returned")
	}
}

func TestRuntimeGracefulStopIsBounded(t *testing.T) {
	o := validOptions()
	o.ShutdownGrace = 800 * time.Millisecond
	h := &hang{started: make(chan struct{})}
	r := start(t, o, func(s *grpc.Server) { toolrunnerv1.RegisterToolRunnerServiceServer(s, h) })

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := toolrunnerv1.NewToolRunnerServiceClient(r.cc).Execute(ctx, &toolrunnerv1.ExecuteRequest{Name: "hang"})
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-h.started:
	case <-time.After(3 * time.Second):
		t.Fatal("handler did not start")
	}

	begin := time.Now()
	r.stop()
	// During the grace period the admin port is still up and says not ready.
	for {
		code, _ := get(t, r.admin+"/readyz")
		if code == http.StatusServiceUnavailable {
			break
		}
		if time.Since(begin) > o.ShutdownGrace {
			t.Error("/readyz did not turn 503 during the graceful stop")
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	select {
	case err := <-r.done:
		elapsed := time.Since(begin)
		if err != nil {
			t.Errorf("Serve = %v", err)
		}
		if elapsed < o.ShutdownGrace {
			t.Errorf("Serve returned after %v, before the grace %v with a call in flight", elapsed, o.ShutdownGrace)
		}
		r.done <- nil
	case <-time.After(o.ShutdownGrace + 2*time.Second):
		t.Fatal("Serve did not return within grace + 2s with a handler that never returns")
	}
	if !h.cancelled.Load() {
		t.Error("the in-flight handler was not cancelled after the grace")
	}
	_, err = st.Recv()
	if c := status.Code(err); c != codes.Unavailable && c != codes.Canceled {
		t.Errorf("client saw %v, want UNAVAILABLE or CANCELED", err)
	}
}

func TestEvery(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	ticks := make(chan time.Time, 100)
	done := make(chan struct{})
	go func() {
		defer close(done)
		service.Every(ctx, 5*time.Millisecond, func(now time.Time) { ticks <- now })
	}()
	var prev time.Time
	for range 3 {
		select {
		case now := <-ticks:
			if !now.After(prev) {
				t.Errorf("tick %v not after %v", now, prev)
			}
			prev = now
		case <-time.After(3 * time.Second):
			t.Fatal("Every did not call fn")
		}
	}
	cancel()
	select {
	case <-done:
	case <-time.After(3 * time.Second):
		t.Fatal("Every did not return after ctx was cancelled")
	}
}

func TestBreakerFlags(t *testing.T) {
	fs, o := newFlags()
	err := service.Parse(fs, []string{"--addr=127.0.0.1:0", "--admin-addr=127.0.0.1:0", "--insecure", "--breaker-ratio=0.7", "--breaker-jitter=0"}, env(map[string]string{
		"CURFEW_BREAKER_OFF":          "false",
		"CURFEW_BREAKER_FAILURES":     "3",
		"CURFEW_BREAKER_MIN_REQUESTS": "8",
		"CURFEW_BREAKER_WINDOW":       "30s",
		"CURFEW_BREAKER_OPEN_TIMEOUT": "2s",
		"CURFEW_BREAKER_RATIO":        "0.9", // the flag wins
	}))
	if err != nil {
		t.Fatal(err)
	}
	r := start(t, *o, nil)
	want := breaker.Config{ConsecutiveFailures: 3, FailureRatio: 0.7, MinRequests: 8, Window: 30 * time.Second,
		OpenTimeout: 2 * time.Second, Jitter: -1}
	if got := r.rt.Breakers.Config(); got != want {
		t.Errorf("breaker config = %+v, want %+v", got, want)
	}

	// The flags' defaults are breaker's (and DefaultBreakerOff); a zero breaker.Flags
	// without flags is breaker's defaults, on.
	fs, o = newFlags()
	if err := service.Parse(fs, []string{"--addr=127.0.0.1:0", "--admin-addr=127.0.0.1:0", "--insecure"}, env(nil)); err != nil {
		t.Fatal(err)
	}
	def := breaker.Config{}.WithDefaults()
	off := def
	off.Off = service.DefaultBreakerOff
	if got := start(t, *o, nil).rt.Breakers.Config(); got != off {
		t.Errorf("default flags: breaker config = %+v, want %+v", got, off)
	}
	if got := start(t, validOptions(), nil).rt.Breakers.Config(); got != def {
		t.Errorf("options without flags: breaker config = %+v, want %+v", got, def)
	}
}

func TestBreakerFlagErrors(t *testing.T) {
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"--breaker-failures=0"}, "--breaker-failures must be at least 1"},
		{[]string{"--breaker-failures=5000000000"}, "at most 4294967295"},
		{[]string{"--breaker-min-requests=0"}, "--breaker-min-requests must be at least 1"},
		{[]string{"--breaker-ratio=0"}, "--breaker-ratio must be in (0, 1]"},
		{[]string{"--breaker-ratio=1.5"}, "--breaker-ratio 1.5: must be in (0, 1]"},
		{[]string{"--breaker-ratio=NaN"}, "--breaker-ratio NaN: must be in (0, 1]"},
		{[]string{"--breaker-window=0s"}, "--breaker-window must be at least 10ms"},
		{[]string{"--breaker-window=5ms"}, "--breaker-window 5ms: must be at least 10ms"},
		{[]string{"--breaker-open-timeout=0s"}, "--breaker-open-timeout must be at least 1ms"},
		{[]string{"--breaker-open-timeout=-1s"}, "--breaker-open-timeout -1s: must be at least 1ms"},
		{[]string{"--breaker-jitter=-0.1"}, "--breaker-jitter must be in [0, 1)"},
		{[]string{"--breaker-jitter=1"}, "--breaker-jitter 1: must be below 1"},
		{[]string{"--breaker-open-timeout=2ms", "--breaker-jitter=0.9"}, "--breaker-jitter 0.9: leaves an open period shorter than 1ms"},
	}
	for _, tc := range cases {
		fs, o := newFlags()
		if err := service.Parse(fs, tc.args, env(nil)); err != nil {
			t.Errorf("%v: Parse = %v", tc.args, err)
			continue
		}
		if err := o.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: Validate = %v, want %q", tc.args, err, tc.want)
		}
	}
	fs, _ := newFlags()
	if err := service.Parse(fs, nil, env(map[string]string{"CURFEW_BREAKER_WINDOW": "soon"})); err == nil ||
		!strings.Contains(err.Error(), "CURFEW_BREAKER_WINDOW") || !strings.Contains(err.Error(), "--breaker-window") {
		t.Errorf("bad env value: %v", err)
	}
}

// failing is a ToolRunnerService whose Execute always fails with UNAVAILABLE.
type failing struct {
	toolrunnerv1.UnimplementedToolRunnerServiceServer
	calls atomic.Int64
	code  codes.Code
}

func (f *failing) Execute(*toolrunnerv1.ExecuteRequest, grpc.ServerStreamingServer[toolrunnerv1.ExecuteResponse]) error {
	f.calls.Add(1)
	return status.Error(f.code, "broken")
}

func execute(t *testing.T, cc *grpc.ClientConn) error {
	t.Helper()
	return executeWithin(t, cc, 10*time.Second)
}

// executeWithin is execute with a call deadline of d.
func executeWithin(t *testing.T, cc *grpc.ClientConn, d time.Duration) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	st, err := toolrunnerv1.NewToolRunnerServiceClient(cc).Execute(ctx, &toolrunnerv1.ExecuteRequest{Name: "x"})
	if err != nil {
		return err
	}
	_, err = st.Recv()
	return err
}

// A handler's UNAVAILABLE is its dependency's failure, relayed by the server chain: the
// service answered, so its callers' breakers stay closed.
func TestRelayedFailuresDoNotOpenTheBreaker(t *testing.T) {
	f := &failing{code: codes.Unavailable}
	server := start(t, validOptions(), func(s *grpc.Server) { toolrunnerv1.RegisterToolRunnerServiceServer(s, f) })
	fs, o := newFlags()
	if err := service.Parse(fs, []string{"--addr=127.0.0.1:0", "--admin-addr=127.0.0.1:0", "--insecure", "--retry-off", "--breaker-failures=2", "--breaker-open-timeout=1h"}, env(nil)); err != nil {
		t.Fatal(err)
	}
	client := start(t, *o, nil)
	cc, err := client.rt.Dial("toolrunner", server.rt.Addr())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	for i := range 10 {
		if err := execute(t, cc); status.Code(err) != codes.Unavailable || breaker.IsOpen(err) {
			t.Fatalf("call %d: %v, want the handler's UNAVAILABLE", i, err)
		}
	}
	if n := f.calls.Load(); n != 10 {
		t.Fatalf("server saw %d calls, want 10", n)
	}
	if st := client.rt.Breakers.Get("toolrunner").State(); st != breaker.StateClosed {
		t.Fatalf("breaker %v after relayed failures", st)
	}
}

func TestDialGuardsEachTargetWithItsBreaker(t *testing.T) {
	f := &failing{code: codes.Internal}
	server := start(t, validOptions(), func(s *grpc.Server) { toolrunnerv1.RegisterToolRunnerServiceServer(s, f) })

	for _, off := range []bool{false, true} {
		f.calls.Store(0)
		fs, o := newFlags()
		args := []string{"--addr=127.0.0.1:0", "--admin-addr=127.0.0.1:0", "--insecure", "--retry-off", "--breaker-failures=2", "--breaker-open-timeout=1h",
			"--breaker-off=" + strconv.FormatBool(off)}
		if err := service.Parse(fs, args, env(nil)); err != nil {
			t.Fatal(err)
		}
		client := start(t, *o, nil)
		cc, err := client.rt.Dial("toolrunner", server.rt.Addr())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cc.Close() })
		for range 5 {
			_ = execute(t, cc)
		}
		if off {
			if n := f.calls.Load(); n != 5 {
				t.Errorf("--breaker-off: server saw %d calls, want 5", n)
			}
			continue
		}
		err = execute(t, cc)
		if oe, ok := breaker.Open(err); !ok || oe.Target != "toolrunner" {
			t.Fatalf("call to an open target: %v, want a BREAKER_OPEN refusal for toolrunner", err)
		}
		if n := f.calls.Load(); n != 2 {
			t.Errorf("server saw %d calls, want 2 (then the breaker opened)", n)
		}
		// Another service name has a breaker of its own.
		other, err := client.rt.Dial("subagent", server.rt.Addr())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = other.Close() })
		if err := execute(t, other); breaker.IsOpen(err) {
			t.Errorf("subagent's breaker refused: %v", err)
		}
		if n := f.calls.Load(); n != 3 {
			t.Errorf("server saw %d calls, want 3", n)
		}
		_, body := get(t, client.admin+"/metrics")
		for _, line := range []string{
			`curfew_circuit_breaker_state{state="open",target="toolrunner"} 1`,
			`curfew_circuit_breaker_state{state="closed",target="toolrunner"} 0`,
			`curfew_circuit_breaker_transitions_total{from="closed",target="toolrunner",to="open"} 1`,
			`curfew_circuit_breaker_state{state="closed",target="subagent"} 1`,
		} {
			if !strings.Contains(body, line) {
				t.Errorf("/metrics lacks %s", line)
			}
		}
	}
}

// A request message above --max-recv-msg-size is refused RESOURCE_EXHAUSTED before any
// handler runs; metadata above --max-header-list-size is refused by the transport.
func TestRequestSizeLimits(t *testing.T) {
	o := validOptions()
	o.MaxRecvMsgSize, o.MaxHeaderListSize = 2<<10, 4<<10
	r := start(t, o, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	hc := healthpb.NewHealthClient(r.cc)
	if _, err := hc.Check(ctx, &healthpb.HealthCheckRequest{Service: strings.Repeat("x", 100)}); status.Code(err) != codes.NotFound {
		t.Fatalf("a small request: %v, want NOT_FOUND for the unknown service", err)
	}
	_, err := hc.Check(ctx, &healthpb.HealthCheckRequest{Service: strings.Repeat("x", 3<<10)})
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("a 3 KiB request against a 2 KiB limit: %v, want RESOURCE_EXHAUSTED", err)
	}
	big := metadata.AppendToOutgoingContext(ctx, "x-padding", strings.Repeat("y", 8<<10))
	if _, err := hc.Check(big, &healthpb.HealthCheckRequest{}); err == nil {
		t.Fatal("8 KiB of metadata against a 4 KiB limit was accepted")
	}
	if _, err := hc.Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatalf("the connection after the refusals: %v", err)
	}
	bad := validOptions()
	bad.MaxRecvMsgSize = 10
	if err := bad.Validate(); err == nil || !strings.Contains(err.Error(), "--max-recv-msg-size") {
		t.Fatalf("a 10-byte limit: %v", err)
	}
}

// A service forgets ended runs' nodes every minute, or twice per --retention when that is
// shorter (never more often than once a second).
func TestSweepEvery(t *testing.T) {
	for r, want := range map[time.Duration]time.Duration{0: time.Minute, time.Hour: time.Minute, 10 * time.Second: 5 * time.Second, time.Second: time.Second} {
		if got := (service.Options{Retention: r}).SweepEvery(); got != want {
			t.Errorf("retention %v: sweep every %v, want %v", r, got, want)
		}
	}
}
