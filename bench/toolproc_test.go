package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/internal/mcptest"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/mesh/md"
)

// The processes the tool benchmarks run: toolrunner on its own (plaintext, no mesh
// around it) with a --tools-config, the test MCP server (internal/mcptest) as its
// sources, and bare go-sdk clients of the same server as the floor.

var (
	toolBinOnce sync.Once
	toolBinDir  string
	toolBinErr  error
	toolBinTemp bool // toolBinDir was made here and is removed by cleanupToolBins
)

// toolBins returns the paths of toolrunner and curfew-mcptest, building them once per
// process (CURFEW_BIN_DIR is used when it holds both). Without a go command to build
// them the benchmark skips (meshproc.Missing).
func toolBins(tb testing.TB) (toolrunner, mcptestBin string) {
	tb.Helper()
	toolBinOnce.Do(func() {
		if d := os.Getenv("CURFEW_BIN_DIR"); d != "" && fileOK(filepath.Join(d, "toolrunner")) && fileOK(filepath.Join(d, "curfew-mcptest")) {
			toolBinDir = d
			return
		}
		if _, err := exec.LookPath("go"); err != nil {
			toolBinErr = errMissingGo
			return
		}
		repo, err := meshproc.Repo()
		if err != nil {
			toolBinErr = err
			return
		}
		if toolBinDir, toolBinErr = os.MkdirTemp("", "curfew-toolbench-"); toolBinErr != nil {
			return
		}
		toolBinTemp = true
		for _, t := range []struct{ name, dir, pkg string }{
			{"toolrunner", filepath.Join(repo, "services", "toolrunner"), "./cmd/toolrunner"},
			{"curfew-mcptest", repo, "./internal/mcptest/cmd/curfew-mcptest"},
		} {
			cmd := exec.Command("go", "build", "-o", filepath.Join(toolBinDir, t.name), t.pkg) //nolint:noctx,gosec // a bounded build of this repository's packages
			cmd.Dir = t.dir
			if out, err := cmd.CombinedOutput(); err != nil {
				toolBinErr = fmt.Errorf("go build %s: %w\n%s", t.name, err, out)
				return
			}
		}
	})
	if errors.Is(toolBinErr, errMissingGo) {
		meshproc.Missing(tb, "the tool benchmarks build toolrunner and curfew-mcptest: %v", toolBinErr)
	}
	if toolBinErr != nil {
		tb.Fatal(toolBinErr)
	}
	return filepath.Join(toolBinDir, "toolrunner"), filepath.Join(toolBinDir, "curfew-mcptest")
}

var errMissingGo = errors.New("no go command on PATH")

func fileOK(p string) bool {
	st, err := os.Stat(p)
	return err == nil && !st.IsDir()
}

// cleanupToolBins removes the binaries toolBins built (called by TestMain).
func cleanupToolBins() {
	if toolBinTemp {
		_ = os.RemoveAll(toolBinDir)
	}
}

// freeAddr returns a loopback address nothing listens on right now.
func freeAddr(tb testing.TB) string {
	tb.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close()
	return addr
}

// trProc is a toolrunner process.
type trProc struct {
	cmd    *exec.Cmd
	admin  string
	conn   *grpc.ClientConn
	client toolrunnerv1.ToolRunnerServiceClient
	stop   func() // stops the process (once; also at the end of the test)
}

// startToolrunner starts toolrunner with the tools file content config ("" for none) and
// returns once its admin endpoint says ready. The process is stopped at the end of tb.
func startToolrunner(tb testing.TB, config string) *trProc {
	tb.Helper()
	bin, _ := toolBins(tb)
	dir := tb.TempDir()
	args := []string{"--insecure", "--addr", freeAddr(tb), "--admin-addr", freeAddr(tb),
		"--subagent", "127.0.0.1:1", "--log-level", "warn", "--drain-delay", "0", "--shutdown-grace", "2s"}
	addr, admin := args[2], args[4]
	if config != "" {
		file := filepath.Join(dir, "tools.json")
		if err := os.WriteFile(file, []byte(config), 0o600); err != nil {
			tb.Fatal(err)
		}
		args = append(args, "--tools-config", file)
	}
	cmd := exec.Command(bin, args...) //nolint:noctx // stopped by SIGTERM in Cleanup
	logf, err := os.Create(filepath.Join(dir, "toolrunner.log"))
	if err != nil {
		tb.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		tb.Fatal(err)
	}
	p := &trProc{cmd: cmd, admin: admin}
	p.stop = sync.OnceFunc(func() {
		if p.conn != nil {
			_ = p.conn.Close()
		}
		_ = cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		_ = logf.Close()
	})
	tb.Cleanup(p.stop)
	hc := http.Client{Timeout: time.Second}
	for end := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if resp, err := hc.Get("http://" + admin + "/readyz"); err == nil {
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				break
			}
		}
		if time.Now().After(end) {
			b, _ := os.ReadFile(logf.Name())
			tb.Fatalf("toolrunner not ready within 30 s:\n%s", b)
		}
	}
	p.conn, err = grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		tb.Fatal(err)
	}
	p.client = toolrunnerv1.NewToolRunnerServiceClient(p.conn)
	return p
}

// newConn opens another client connection to the same toolrunner.
func (p *trProc) newConn(tb testing.TB) toolrunnerv1.ToolRunnerServiceClient {
	tb.Helper()
	c, err := grpc.NewClient(p.conn.Target(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = c.Close() })
	return toolrunnerv1.NewToolRunnerServiceClient(c)
}

// callCtx carries the metadata an agent's call of Execute carries: the run and the node.
func callCtx(ctx context.Context, run string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, md.RunID, run, md.NodeID, "root/s0.t0")
}

// execute runs one Execute call to its end and returns the result's output.
func execute(ctx context.Context, c toolrunnerv1.ToolRunnerServiceClient, run, name, args string) (string, error) {
	st, err := c.Execute(callCtx(ctx, run), &toolrunnerv1.ExecuteRequest{Name: name, ArgsJson: args})
	if err != nil {
		return "", err
	}
	out := ""
	got := false
	for {
		r, err := st.Recv()
		if errors.Is(err, io.EOF) {
			if !got {
				return "", errors.New(name + ": the stream ended without a result")
			}
			return out, nil
		}
		if err != nil {
			return "", err
		}
		if res := r.GetResult(); res != nil {
			out, got = res.GetOutputJson(), true
		}
	}
}

// executeProgress runs an Execute call to its end, signalling its first node event
// (the tool's first progress report) on progress.
func executeProgress(ctx context.Context, c toolrunnerv1.ToolRunnerServiceClient, run, name, args string, progress chan<- struct{}) error {
	st, err := c.Execute(callCtx(ctx, run), &toolrunnerv1.ExecuteRequest{Name: name, ArgsJson: args})
	if err != nil {
		return err
	}
	signalled := false
	for {
		r, err := st.Recv()
		if err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		if r.GetNodeEvent() != nil && !signalled {
			signalled = true
			progress <- struct{}{}
		}
	}
}

// waitTools calls each named tool with args until it succeeds: the sources are open and
// listed.
func waitTools(tb testing.TB, c toolrunnerv1.ToolRunnerServiceClient, names []string, args string) {
	tb.Helper()
	end := time.Now().Add(60 * time.Second)
	for _, n := range names {
		for {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			_, err := execute(ctx, c, "bench-warm", n, args)
			cancel()
			if err == nil {
				break
			}
			if time.Now().After(end) {
				tb.Fatalf("%s not callable within 60 s: %v", n, err)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
}

// startMCPHTTP starts curfew-mcptest --http on loopback, recording into record, and
// returns its endpoint URL.
func startMCPHTTP(tb testing.TB, record string) string {
	tb.Helper()
	_, bin := toolBins(tb)
	cmd := exec.Command(bin, "--http", "127.0.0.1:0", "--record", record) //nolint:noctx // stopped in Cleanup
	stderr, err := cmd.StderrPipe()
	if err != nil {
		tb.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		_ = cmd.Wait()
	})
	sc := bufio.NewScanner(stderr)
	for sc.Scan() {
		if a, ok := strings.CutPrefix(sc.Text(), "listening on "); ok {
			go func() { _, _ = io.Copy(io.Discard, stderr) }()
			return "http://" + a + "/"
		}
	}
	tb.Fatal("curfew-mcptest --http exited before listening")
	return ""
}

// bareClient is a go-sdk client that signals progress reports on progress (without
// blocking: a report finding progress full is dropped).
func bareClient(progress chan<- struct{}) *mcp.Client {
	return mcp.NewClient(&mcp.Implementation{Name: "bench", Version: "1"}, &mcp.ClientOptions{
		ProgressNotificationHandler: func(context.Context, *mcp.ProgressNotificationClientRequest) {
			select {
			case progress <- struct{}{}:
			default:
			}
		},
	})
}

// bareStdio is a bare go-sdk client session with its own curfew-mcptest child.
func bareStdio(tb testing.TB, record string, progress chan<- struct{}) *mcp.ClientSession {
	tb.Helper()
	_, bin := toolBins(tb)
	c := bareClient(progress)
	cs, err := c.Connect(context.Background(), &mcp.CommandTransport{Command: exec.Command(bin, "--record", record)}, nil) //nolint:noctx // the session ends the child
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = cs.Close() })
	return cs
}

// bareHTTP is a bare go-sdk client session of the server at url.
func bareHTTP(tb testing.TB, url string, progress chan<- struct{}) *mcp.ClientSession {
	tb.Helper()
	c := bareClient(progress)
	cs, err := c.Connect(context.Background(), &mcp.StreamableClientTransport{Endpoint: url}, nil)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = cs.Close() })
	return cs
}

// recordFile follows a --record file.
type recordFile struct {
	path string
	seen int // records consumed
}

// next waits (up to within) for the record after the last one consumed and returns it.
func (r *recordFile) next(within time.Duration) (mcptest.Record, error) {
	end := time.Now().Add(within)
	for {
		recs, err := mcptest.ReadRecords(r.path)
		if err == nil && len(recs) > r.seen {
			r.seen++
			return recs[r.seen-1], nil
		}
		if time.Now().After(end) {
			if err != nil {
				return mcptest.Record{}, fmt.Errorf("%s: no record %d within %v: %w", r.path, r.seen+1, within, err)
			}
			return mcptest.Record{}, fmt.Errorf("%s: no record %d within %v", r.path, r.seen+1, within)
		}
		time.Sleep(2 * time.Millisecond)
	}
}
