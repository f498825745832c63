package bench

import (
	"bufio"
	"strings"
	"testing"
)

// firstContent skips the role chunk, comments and blank lines, and stops at the first
// chunk with content; a stream without one is an error.
func TestFirstContent(t *testing.T) {
	stream := ": keep-alive\n\n" +
		`data: {"id":"r1","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}` + "\n\n" +
		`data: {"id":"r1","choices":[{"index":0,"delta":{"content":"Hello"}}]}` + "\n\n" +
		"data: [DONE]\n\n"
	c, err := firstContent(bufio.NewReader(strings.NewReader(stream)))
	if err != nil || c.ID != "r1" || c.Choices[0].Delta.Content != "Hello" {
		t.Fatalf("%+v, %v", c, err)
	}
	empty := `data: {"id":"r2","choices":[{"index":0,"delta":{"role":"assistant"}}]}` + "\n\ndata: [DONE]\n\n"
	if _, err := firstContent(bufio.NewReader(strings.NewReader(empty))); err == nil {
		t.Fatal("a stream without content: no error")
	}
	if _, err := firstContent(bufio.NewReader(strings.NewReader(`data: {"choices":[`))); err == nil {
		t.Fatal("a truncated stream: no error")
	}
}
