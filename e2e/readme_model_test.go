package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/internal/ollamatest"
)

// TestRunRealInferenceServer: a run through the whole mesh (orchestrator → modelproxy →
// a real ollama server with a tiny model, internal/ollamatest), configured as README.md's
// "Run a real model" says, and its commands, curl line and Go snippet as written.
//
// The README names Ollama's default address and llama3.2; the test substitutes the
// ollamatest server's address and model in the providers file, and the mesh's own ports
// for 7700 and 7708 (its mesh picks free ports). Everything else runs as written.
//
// Checked: the run succeeds with an answer; the summary's model node counts prompt and
// output tokens; the TextDelta events of the Run stream add up to the answer; a client
// that disconnects mid-generation stops ollama's decoder within ollamatest's bounds (the
// server's access log and its runner's CPU time, ollamatest.CancelResult.Check). Not parallel: it times a decoder on a
// 2-core machine.
func TestRunRealInferenceServer(t *testing.T) {
	repo, blocks := readmeBlocks(t)
	srv := ollamatest.Start(t, ollamatest.Options{})

	// The providers file: the README's, pointed at the ollamatest server.
	const readmeURL, readmeModel = "http://127.0.0.1:11434/v1", "llama3.2"
	cfgText := blocks["providers.json"]
	if !json.Valid([]byte(cfgText)) || !strings.Contains(cfgText, readmeURL) || !strings.Contains(cfgText, readmeModel) {
		t.Fatalf("README.md's providers.json is missing, not JSON, or does not name %s and %s:\n%s", readmeURL, readmeModel, cfgText)
	}
	cfgText = strings.ReplaceAll(strings.ReplaceAll(cfgText, readmeURL, srv.BaseURL), readmeModel, srv.Model)
	var cfg struct {
		Models map[string]any `json:"models"`
	}
	if err := json.Unmarshal([]byte(cfgText), &cfg); err != nil || len(cfg.Models) != 1 {
		t.Fatalf("README.md's providers.json should name one alias: %v", err)
	}
	var alias string
	for a := range cfg.Models {
		alias = a
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "providers.json"), []byte(cfgText), 0o600); err != nil {
		t.Fatal(err)
	}

	// The commands: curfew up's flags (run from dir, which holds providers.json) and the
	// curfew run line, run by a shell for its quoting.
	var upArgs []string
	var runLine string
	for line := range strings.Lines(blocks["model-commands"]) {
		line = strings.TrimSpace(line)
		f := strings.Fields(strings.TrimSuffix(line, "&"))
		switch {
		case len(f) == 0:
		case len(f) >= 2 && f[0] == "curfew" && f[1] == "up":
			upArgs = f[2:]
		case len(f) >= 2 && f[0] == "curfew" && f[1] == "run":
			runLine = line
		default:
			t.Fatalf("README.md's model example has a command this test does not run: %q", line)
		}
	}
	if upArgs == nil || runLine == "" || !strings.Contains(runLine, "--model "+alias) {
		t.Fatalf("README.md's model example lacks curfew up, or a curfew run of model %s:\n%s", alias, blocks["model-commands"])
	}

	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	data := t.TempDir()
	m, err := meshproc.Start(ctx, data, meshproc.Options{Args: upArgs, Dir: dir})
	if err != nil {
		t.Fatalf("curfew up %s: %v", strings.Join(upArgs, " "), err)
	}
	t.Cleanup(func() {
		if err := m.Stop(); err != nil {
			t.Errorf("curfew up did not stop cleanly: %v", err)
		}
	})

	t.Run("curfew run", func(t *testing.T) {
		cmd := exec.CommandContext(ctx, "bash", "-c", runLine)
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "PATH="+m.Bin+":"+os.Getenv("PATH"), "CURFEW_DATA_DIR="+data)
		out, err := cmd.CombinedOutput()
		if err != nil || !strings.Contains(string(out), " succeeded\n") || !strings.Contains(string(out), "root/m0: ") {
			t.Fatalf("%s: %v, want a succeeded run that printed the root's text:\n%s", runLine, err, out)
		}
		t.Logf("%s:\n%s", runLine, out)
	})

	oc, err := m.Orchestrator()
	if err != nil {
		t.Fatal(err)
	}
	t.Run("stream", func(t *testing.T) {
		st, err := oc.Run(ctx, &orchestratorv1.RunRequest{Task: "Tell me about the night bell.", Model: alias, MaxTokens: 40})
		if err != nil {
			t.Fatal(err)
		}
		tp := record(st, splitRun)
		tp.wait(t)
		r := tp.finished
		if tp.err != nil || r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED || r.GetAnswer() == "" {
			t.Fatalf("run: %v, %v", tp.err, dump(r))
		}
		n := nodeMap(r)["root/m0"]
		if n.GetPromptTokens() <= 0 || n.GetTokens() <= 0 || n.GetTokens() > 40 || n.GetProvider() != "ollama" {
			t.Errorf("the model node: %d prompt tokens, %d tokens, provider %q; want both > 0, ≤ 40 tokens, ollama", n.GetPromptTokens(), n.GetTokens(), n.GetProvider())
		}
		if r.GetPromptTokens() < n.GetPromptTokens() {
			t.Errorf("the run counts %d prompt tokens, its model node %d", r.GetPromptTokens(), n.GetPromptTokens())
		}
		// ollama holds back a completion offered tools until it ends (see disconnect), so
		// the text comes in few deltas, but it is the answer.
		ds, text := tp.text("root/m0")
		if len(ds) == 0 || text != r.GetAnswer() {
			t.Errorf("%d text deltas adding up to %q; the run answered %q", len(ds), text, r.GetAnswer())
		}
		t.Logf("%d prompt tokens, %d tokens in %d deltas: %q", n.GetPromptTokens(), n.GetTokens(), len(ds), text)
	})

	key := tenantKeyOf(ctx, t, m, "readme", false)
	t.Run("curl", func(t *testing.T) {
		line := strings.TrimSpace(blocks["curl"])
		if !strings.HasPrefix(line, "curl ") || !strings.Contains(line, "http://127.0.0.1:7708/v1") {
			t.Fatalf("README.md's curl block is not a curl line to the front door: %q", line)
		}
		line = strings.ReplaceAll(line, "http://127.0.0.1:7708", "http://"+m.Endpoints.Services["orchestrator"].OpenAIAddr)
		line = strings.ReplaceAll(line, `"model": "local"`, `"model": "`+alias+`", "max_tokens": 20`)
		cmd := exec.CommandContext(ctx, "bash", "-c", line)
		cmd.Env = append(os.Environ(), "CURFEW_API_KEY="+key)
		out, err := cmd.Output()
		var c struct {
			Choices []struct {
				Message struct {
					Content string `json:"content"`
				} `json:"message"`
			} `json:"choices"`
		}
		if err != nil || json.Unmarshal(out, &c) != nil || len(c.Choices) != 1 || c.Choices[0].Message.Content == "" {
			t.Fatalf("%s: %v, want a chat.completion with an answer:\n%s", line, err, out)
		}
	})

	t.Run("go client builds", func(t *testing.T) {
		src := "package main\n\nimport (\n\t\"context\"\n\t\"fmt\"\n\t\"log\"\n\t\"os\"\n\t\"time\"\n\n\t\"github.com/curfew-mesh/curfew/client\"\n)\n\nfunc main() {\n" +
			blocks["go-client"] + "}\n"
		if !strings.Contains(blocks["go-client"], "client.New(") {
			t.Fatalf("README.md's go-client block is missing:\n%s", blocks["go-client"])
		}
		// The snippet joins the repository's module through an overlay, so that nothing is
		// written into the repository.
		tmp := t.TempDir()
		main := filepath.Join(tmp, "main.go")
		if err := os.WriteFile(main, []byte(src), 0o600); err != nil {
			t.Fatal(err)
		}
		overlay, _ := json.Marshal(map[string]any{"Replace": map[string]string{filepath.Join(repo, "internal", "readmesnippet", "main.go"): main}})
		ov := filepath.Join(tmp, "overlay.json")
		if err := os.WriteFile(ov, overlay, 0o600); err != nil {
			t.Fatal(err)
		}
		cmd := exec.CommandContext(ctx, "go", "build", "-overlay", ov, "-o", filepath.Join(tmp, "snippet"), "./internal/readmesnippet")
		cmd.Dir = repo
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("go build of README.md's Go snippet: %v\n%s\n%s", err, out, src)
		}
	})

	// A client that disconnects mid-generation: the run is cancelled, and ollama's request
	// ends and its decoder stops within ollamatest's bounds.
	t.Run("disconnect", func(t *testing.T) {
		// ollama v0.6.8 holds back a completion offered tools (the agent loop offers its
		// tools on every step) until it ends, so no text reaches the caller while it
		// decodes: the cancel comes once the runner's CPU shows decoding.
		var runID string // written before the call returns, read after
		res := ollamatest.CancelWhileDecoding(ctx, t, srv, func(ctx context.Context) error {
			st, err := oc.Run(ctx, &orchestratorv1.RunRequest{Task: "Tell me a long story about the night bell.", Model: alias})
			if err != nil {
				return err
			}
			for {
				resp, err := st.Recv()
				if errors.Is(err, io.EOF) {
					return nil
				}
				if err != nil {
					return err
				}
				if s := resp.GetStarted(); s != nil {
					runID = s.GetRunId()
				}
			}
		})
		res.Check(t)
		if status.Code(res.CallErr) != codes.Canceled {
			t.Errorf("the disconnected Run ended with %v, want CANCELLED", res.CallErr)
		}
		// The run is over by now: CancelWhileDecoding watched the runner for 2 s after it.
		got, err := oc.GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: runID})
		if r := got.GetRun(); err != nil || r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_CANCELLED || r.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT {
			t.Errorf("GetRun %q: %v, %v; want CANCELLED by client_disconnect", runID, err, dump(r))
		}
	})
}
