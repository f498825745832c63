package manifest

import (
	"bufio"
	"bytes"
	"strings"
)

func bufioReader(b []byte) *bufio.Reader { return bufio.NewReader(bytes.NewReader(b)) }

// firstLine returns the first line of doc that starts (after indentation) with prefix,
// trimmed, to name a document in errors.
func firstLine(doc []byte, prefix string) string {
	for _, l := range strings.Split(string(doc), "\n") {
		if t := strings.TrimSpace(l); strings.HasPrefix(t, prefix) {
			return t
		}
	}
	return ""
}
