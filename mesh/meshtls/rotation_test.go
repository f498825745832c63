package meshtls_test

import (
	"bytes"
	"context"
	"errors"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/mesh/meshtls"
)

// load makes calls until stopped, over the long-lived connection and over a new
// connection each time (a new handshake), and returns the errors.
type load struct {
	stop context.CancelFunc
	wg   sync.WaitGroup
	mu   sync.Mutex
	errs []error
	n    int
}

func startLoad(t *testing.T, srv *server, creds credentials.TransportCredentials) *load {
	t.Helper()
	conn := dial(t, srv.addr, creds)
	ctx, cancel := context.WithCancel(t.Context())
	l := &load{stop: cancel}
	l.wg.Go(func() {
		for ctx.Err() == nil {
			_, err1 := check(ctx, conn)
			_, err2 := checkOnce(ctx, srv.addr, creds)
			l.mu.Lock()
			l.n += 2
			for _, err := range []error{err1, err2} {
				if err != nil && ctx.Err() == nil {
					l.errs = append(l.errs, err)
				}
			}
			l.mu.Unlock()
		}
	})
	return l
}

// waitCalls waits until n more calls have been made.
func (l *load) waitCalls(t *testing.T, n int) {
	t.Helper()
	l.mu.Lock()
	n += l.n
	l.mu.Unlock()
	eventually(t, "calls made", func() bool {
		l.mu.Lock()
		defer l.mu.Unlock()
		return l.n >= n
	})
}

// end stops the calls and fails the test if one failed.
func (l *load) end(t *testing.T) {
	t.Helper()
	l.stop()
	l.wg.Wait()
	if len(l.errs) > 0 {
		t.Fatalf("%d of %d calls failed during the rotation, first: %v", len(l.errs), l.n, l.errs[0])
	}
	t.Logf("%d calls during the rotation, none failed", l.n)
}

// watch opens a health Watch stream on a connection of creds and reads its first status.
func watch(t *testing.T, srv *server, creds credentials.TransportCredentials) healthpb.Health_WatchClient {
	t.Helper()
	w, err := healthpb.NewHealthClient(dial(t, srv.addr, creds)).Watch(t.Context(), &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if resp, err := w.Recv(); err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("watch: %v, %v", resp, err)
	}
	return w
}

// stillStreams checks that the stream w delivers a status change.
func stillStreams(t *testing.T, srv *server, w healthpb.Health_WatchClient) {
	t.Helper()
	srv.health.SetServingStatus("", healthpb.HealthCheckResponse_NOT_SERVING)
	if resp, err := w.Recv(); err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Fatalf("the stream opened before the rotation: %v, %v", resp, err)
	}
	srv.health.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
}

func TestServerCertificateRotation(t *testing.T) {
	m := newMesh(t)
	srv := meshServer(t, m, meshtls.ToolRunner, meshtls.RequireClientCert)
	creds := meshtls.ClientCredentials(m.source(t, meshtls.Orchestrator), meshtls.ToolRunner)
	long := dial(t, srv.addr, creds)
	before, err := check(t.Context(), long)
	if err != nil {
		t.Fatal(err)
	}
	w := watch(t, srv, creds)
	l := startLoad(t, srv, creds)
	l.waitCalls(t, 4)

	m.issue(t, meshtls.ToolRunner)
	want := m.leaf(t, meshtls.ToolRunner).SerialNumber
	if want.Cmp(serial(before)) == 0 {
		t.Fatal("the re-issued certificate has the old serial")
	}
	eventually(t, "a new connection presents the new certificate", func() bool {
		cs, err := checkOnce(t.Context(), srv.addr, creds)
		return err == nil && serial(cs).Cmp(want) == 0
	})
	l.waitCalls(t, 4)
	l.end(t)
	stillStreams(t, srv, w)
	if cs, err := check(t.Context(), long); err != nil || serial(cs).Cmp(serial(before)) != 0 {
		t.Errorf("the connection made before the rotation: serial %x, %v; want the old %x", serial(cs), err, serial(before))
	}
}

func TestClientCertificateRotation(t *testing.T) {
	m := newMesh(t)
	srv := meshServer(t, m, meshtls.ToolRunner, meshtls.RequireClientCert)
	creds := meshtls.ClientCredentials(m.source(t, meshtls.Orchestrator), meshtls.ToolRunner)
	// A first handshake, so that later ones could resume its session.
	if _, err := checkOnce(t.Context(), srv.addr, creds); err != nil {
		t.Fatal(err)
	}
	l := startLoad(t, srv, creds)
	l.waitCalls(t, 4)
	m.issue(t, meshtls.Orchestrator)
	want := m.leaf(t, meshtls.Orchestrator).SerialNumber
	eventually(t, "the server sees the new client certificate on a new connection", func() bool {
		_, err := checkOnce(t.Context(), srv.addr, creds)
		return err == nil && srv.seen.saw(want)
	})
	l.waitCalls(t, 4)
	l.end(t)
}

func TestSessionResumption(t *testing.T) {
	m := newMesh(t)
	srv := meshServer(t, m, meshtls.ToolRunner, meshtls.RequireClientCert)
	creds := meshtls.ClientCredentials(m.source(t, meshtls.Orchestrator), meshtls.ToolRunner)
	if cs, err := checkOnce(t.Context(), srv.addr, creds); err != nil || cs.DidResume {
		t.Fatalf("first connection: resumed %v, %v", cs.DidResume, err)
	}
	// The session ticket arrives after the handshake; a later connection resumes.
	eventually(t, "a new connection resumes the session", func() bool {
		cs, err := checkOnce(t.Context(), srv.addr, creds)
		return err == nil && cs.DidResume
	})
	if id, _ := srv.seen.last(); id != meshtls.Orchestrator {
		t.Errorf("identity on a resumed session = %q, want orchestrator", id)
	}
	// A rotation of the server's certificate ends resumption with it.
	m.issue(t, meshtls.ToolRunner)
	time.Sleep(2 * testInterval)
	cs, err := checkOnce(t.Context(), srv.addr, creds)
	if err != nil || cs.DidResume || serial(cs).Cmp(m.leaf(t, meshtls.ToolRunner).SerialNumber) != 0 {
		t.Errorf("after the rotation: resumed %v, serial %x, %v; want a full handshake with the new certificate", cs.DidResume, serial(cs), err)
	}
}

// TestCARotation rotates the CA and every certificate during calls, with the documented
// transition: none fails, and the old CA is no longer trusted at the end.
func TestCARotation(t *testing.T) {
	m := newMesh(t)
	oldCA := m.ca.Certificate()
	oldClient := copyFiles(t, m.dir, "orchestrator.crt", "orchestrator.key")
	srv := meshServer(t, m, meshtls.ToolRunner, meshtls.RequireClientCert)
	creds := meshtls.ClientCredentials(m.source(t, meshtls.Orchestrator), meshtls.ToolRunner)
	w := watch(t, srv, creds)
	l := startLoad(t, srv, creds)
	l.waitCalls(t, 4)

	ca, err := meshtls.RotateCA(m.dir)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(filepath.Join(m.dir, meshtls.CACertFile))
	if n := bytes.Count(b, []byte("BEGIN CERTIFICATE")); n != 2 {
		t.Fatalf("ca.crt holds %d certificates during the rotation, want the new and the old", n)
	}
	if again, err := meshtls.EnsureCA(m.dir); err != nil || !again.Certificate().Equal(ca.Certificate()) {
		t.Fatalf("EnsureCA after RotateCA: %v; want the new CA", err)
	}
	m.ca = ca
	time.Sleep(2 * testInterval) // every Source trusts both CAs
	for _, id := range identities {
		m.issue(t, id)
	}
	want := m.leaf(t, meshtls.ToolRunner)
	if !bytes.Equal(want.AuthorityKeyId, ca.Certificate().SubjectKeyId) {
		t.Fatal("the re-issued certificate is not the new CA's")
	}
	eventually(t, "new connections use the new CA's certificates", func() bool {
		cs, err := checkOnce(t.Context(), srv.addr, creds)
		return err == nil && serial(cs).Cmp(want.SerialNumber) == 0 && srv.seen.saw(m.leaf(t, meshtls.Orchestrator).SerialNumber)
	})
	time.Sleep(2 * testInterval) // every Source has its new certificate
	if err := ca.FinishRotation(m.dir); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * testInterval)
	if _, err := checkOnce(t.Context(), srv.addr, creds); err != nil {
		t.Fatal(err)
	}
	l.waitCalls(t, 4)
	l.end(t)
	stillStreams(t, srv, w)

	// A client still holding the old CA's certificate is refused, even trusting the new CA.
	b, _ = os.ReadFile(filepath.Join(m.dir, meshtls.CACertFile))
	if err := os.WriteFile(filepath.Join(oldClient, meshtls.CACertFile), b, 0o600); err != nil {
		t.Fatal(err)
	}
	stale, err := meshtls.NewSource(oldClient, meshtls.Orchestrator, quiet)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(stale.Certificate().AuthorityKeyId, oldCA.SubjectKeyId) {
		t.Fatal("the stale client's certificate is not the old CA's")
	}
	_, err = checkOnce(t.Context(), srv.addr, meshtls.ClientCredentials(stale, meshtls.ToolRunner))
	meshtest.WantCode(t, err, codes.Unavailable)
}

// TestBadFilesKeepTheLastGoodOnes: a rotation half written, files that do not parse
// and a certificate of another identity leave the Source serving its last good state.
func TestBadFilesKeepTheLastGoodOnes(t *testing.T) {
	m := newMesh(t)
	src := m.source(t, meshtls.ToolRunner)
	first := src.Certificate().SerialNumber
	srv := serve(t, meshtls.ServerCredentials(src, meshtls.RequireClientCert), nil, meshtls.ToolRunner)
	creds := meshtls.ClientCredentials(m.source(t, meshtls.Orchestrator), meshtls.ToolRunner)
	path := func(name string) string { return filepath.Join(m.dir, name) }
	write := func(name string, data []byte) {
		t.Helper()
		if err := os.WriteFile(path(name), data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	read := func(name string) []byte {
		t.Helper()
		b, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	// serves checks that a new connection is served the certificate of serial.
	serves := func(what string, want *big.Int) {
		t.Helper()
		time.Sleep(2 * testInterval)
		cs, err := checkOnce(t.Context(), srv.addr, creds)
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if serial(cs).Cmp(want) != 0 {
			t.Fatalf("%s: serial %x served, want %x", what, serial(cs), want)
		}
	}
	wantErr := func(what, contains string, errors uint64) {
		t.Helper()
		err := src.Reload()
		if err == nil || !strings.Contains(err.Error(), contains) {
			t.Fatalf("%s: Reload = %v, want an error with %q", what, err, contains)
		}
		if st := src.Stats(); st.Errors != errors || st.LastError == nil {
			t.Fatalf("%s: stats %+v, want %d errors", what, st, errors)
		}
		if got := src.Certificate().SerialNumber; got.Cmp(first) != 0 {
			t.Fatalf("%s: certificate %x in use, want the last good %x", what, got, first)
		}
		serves(what, first)
	}

	next := t.TempDir()
	if err := m.ca.Issue(next, meshtls.ToolRunner, 0); err != nil {
		t.Fatal(err)
	}
	nextCrt, nextKey := read(filepath.Join(next, "toolrunner.crt")), read(filepath.Join(next, "toolrunner.key"))

	// A rotation half written: the new key beside the old certificate.
	write("toolrunner.key", nextKey)
	wantErr("new key, old certificate", "private key does not match public key", 1)
	// The same bad state is retried, not counted again.
	serves("the same bad state", first)
	if st := src.Stats(); st.Errors != 1 {
		t.Fatalf("the same bad state counted again: %+v", st)
	}
	// A certificate cut short.
	write("toolrunner.crt", nextCrt[:len(nextCrt)/2])
	wantErr("half a certificate", "failed to find any PEM data in certificate input", 2)
	// A ca.crt that does not parse, beside the pair still half written.
	goodCA := read(path(meshtls.CACertFile))
	write(meshtls.CACertFile, []byte("not a certificate"))
	wantErr("garbage ca.crt", "no PEM certificate", 3)

	// The pair completed: taken, though ca.crt is still bad.
	write("toolrunner.crt", nextCrt)
	if err := src.Reload(); err == nil || !strings.Contains(err.Error(), "no PEM certificate") {
		t.Fatalf("Reload with a good pair and a bad ca.crt = %v", err)
	}
	second := src.Certificate().SerialNumber
	if second.Cmp(first) == 0 {
		t.Fatal("the completed pair was not taken")
	}
	serves("a good pair beside a bad ca.crt", second)
	write(meshtls.CACertFile, goodCA)
	if err := src.Reload(); err != nil {
		t.Fatal(err)
	}
	if st := src.Stats(); st.LastError != nil || st.Reloads != 2 {
		t.Fatalf("stats %+v, want 2 reloads (the first load and the new pair) and no error", st)
	}

	// The certificate of another identity (a copy gone wrong).
	write("toolrunner.crt", read(path("subagent.crt")))
	write("toolrunner.key", read(path("subagent.key")))
	err := src.Reload()
	if err == nil || !strings.Contains(err.Error(), "certificate is not for spiffe://curfew.local/toolrunner") {
		t.Fatalf("Reload of subagent's pair = %v", err)
	}
	if got := src.Certificate().SerialNumber; got.Cmp(second) != 0 {
		t.Fatalf("certificate %x in use, want %x", got, second)
	}
	// Missing files.
	if err := os.Remove(path("toolrunner.key")); err != nil {
		t.Fatal(err)
	}
	if err := src.Reload(); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("Reload without a key file = %v", err)
	}
	serves("no key file", second)
}

func TestNewSourceErrors(t *testing.T) {
	m := newMesh(t)
	if _, err := meshtls.NewSource(m.dir, "Tool Runner", quiet); err == nil {
		t.Error("NewSource took an invalid identity")
	}
	if _, err := meshtls.NewSource(m.dir, "gateway", quiet); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("NewSource without files = %v", err)
	}
	if err := os.WriteFile(filepath.Join(m.dir, "toolrunner.key"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := meshtls.NewSource(m.dir, meshtls.ToolRunner, quiet); err == nil {
		t.Error("NewSource took a bad key")
	}
	src, err := meshtls.NewSource(m.dir, meshtls.Subagent, quiet)
	if err != nil {
		t.Fatal(err)
	}
	if src.Identity() != meshtls.Subagent || src.Stats().Reloads != 1 {
		t.Errorf("Identity %q, stats %+v", src.Identity(), src.Stats())
	}
}

// TestSymlinkSwap: a Kubernetes Secret volume is updated by swapping its ..data link to
// a new directory; the files are links through it.
func TestSymlinkSwap(t *testing.T) {
	m := newMesh(t)
	vol := t.TempDir()
	files := []string{meshtls.CACertFile, "toolrunner.crt", "toolrunner.key"}
	version := func(name string) {
		t.Helper()
		if err := os.Rename(copyFiles(t, m.dir, files...), filepath.Join(vol, name)); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(name, filepath.Join(vol, "..data.tmp")); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(filepath.Join(vol, "..data.tmp"), filepath.Join(vol, "..data")); err != nil {
			t.Fatal(err)
		}
	}
	version("..v1")
	for _, f := range files {
		if err := os.Symlink(filepath.Join("..data", f), filepath.Join(vol, f)); err != nil {
			t.Fatal(err)
		}
	}
	src, err := meshtls.NewSource(vol, meshtls.ToolRunner, quiet)
	if err != nil {
		t.Fatal(err)
	}
	first := src.Certificate().SerialNumber
	m.issue(t, meshtls.ToolRunner)
	version("..v2")
	if err := src.Reload(); err != nil {
		t.Fatal(err)
	}
	if got, want := src.Certificate().SerialNumber, m.leaf(t, meshtls.ToolRunner).SerialNumber; got.Cmp(want) != 0 || got.Cmp(first) == 0 {
		t.Errorf("after the swap: serial %x, want the new %x", got, want)
	}
}
