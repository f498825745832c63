package ollamatest

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// chunk is one streamed chat.completion.chunk.
type chunk struct {
	Choices []struct {
		Delta struct {
			Content string `json:"content"`
		} `json:"delta"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
	Usage *struct {
		CompletionTokens int `json:"completion_tokens"`
	} `json:"usage"`
}

// stream posts a streaming chat completion and calls onChunk for each chunk until the
// stream ends, onChunk returns false, or ctx ends. Plain net/http and SSE, as any OpenAI
// client speaks it.
func stream(ctx context.Context, t *testing.T, s *Server, maxTokens int, onChunk func(chunk) bool) error {
	t.Helper()
	body, _ := json.Marshal(map[string]any{
		"model":          s.Model,
		"messages":       []map[string]string{{"role": "user", "content": "Tell me a long story about the night bell."}},
		"stream":         true,
		"max_tokens":     maxTokens,
		"stream_options": map[string]bool{"include_usage": true},
	})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.BaseURL+"/chat/completions", bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		return err
	}
	defer func() { _ = resp.Body.Close() }()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("status %s", resp.Status)
	}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if ctx.Err() != nil { // cancelled: a client reads nothing more
			return ctx.Err()
		}
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			return nil
		}
		var c chunk
		if err := json.Unmarshal([]byte(data), &c); err != nil {
			return fmt.Errorf("chunk %q: %w", data, err)
		}
		if !onChunk(c) {
			return nil
		}
	}
	if err := sc.Err(); err != nil {
		return err
	}
	return errors.New("stream ended without [DONE]")
}

// TestStreamRunsLong: a real streamed completion, hundreds of tokens at one thread, ended
// by max_tokens ("length"), never by end-of-text.
func TestStreamRunsLong(t *testing.T) {
	s := Start(t, Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const want = 300
	var tokens, usage int
	var finish string
	var text strings.Builder
	start := time.Now()
	err := stream(ctx, t, s, want, func(c chunk) bool {
		for _, ch := range c.Choices {
			if ch.Delta.Content != "" {
				tokens++
				text.WriteString(ch.Delta.Content)
			}
			if ch.FinishReason != nil {
				finish = *ch.FinishReason
			}
		}
		if c.Usage != nil {
			usage = c.Usage.CompletionTokens
		}
		return true
	})
	if err != nil {
		t.Fatal(err)
	}
	el := time.Since(start)
	if tokens < want*9/10 || finish != "length" {
		t.Errorf("%d content chunks, finish_reason %q; want about %d and \"length\"", tokens, finish, want)
	}
	if usage != want {
		t.Errorf("usage.completion_tokens %d, want %d", usage, want)
	}
	t.Logf("%d tokens in %v (%.0f tokens/s, 1 thread); text starts %q", tokens, el.Round(time.Millisecond),
		float64(tokens)/el.Seconds(), truncate(text.String(), 80))
	r, err := s.WaitRequest(ctx, "POST /v1/chat/completions", start)
	if err != nil {
		t.Fatal(err)
	}
	if r.Status != http.StatusOK {
		t.Errorf("server logged status %d", r.Status)
	}
}

// TestCancelStopsGeneration: the client goes away mid-stream; from the server's side the
// request ends within requestEndBound and the runner stops decoding (its CPU time is flat).
func TestCancelStopsGeneration(t *testing.T) {
	s := Start(t, Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	res := CancelMidStream(ctx, t, s, func(ctx context.Context, onToken func()) error {
		return stream(ctx, t, s, 100000, func(c chunk) bool {
			for _, ch := range c.Choices {
				if ch.Delta.Content != "" {
					onToken()
				}
			}
			return true
		})
	})
	res.Check(t)
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// TestStopLeavesNoProcess: Stop ends the server and the runner it spawned.
func TestStopLeavesNoProcess(t *testing.T) {
	s := Start(t, Options{})
	pids := append([]int{s.cmd.Process.Pid}, s.RunnerPIDs()...)
	if len(pids) < 2 {
		t.Fatalf("no runner after the warm-up: %v", pids)
	}
	if err := s.Stop(); err != nil {
		t.Fatal(err)
	}
	for _, p := range pids {
		if alive(p) {
			t.Errorf("process %d still running after Stop", p)
		}
	}
}
