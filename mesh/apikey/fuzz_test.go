package apikey_test

import (
	"strings"
	"testing"

	"github.com/curfew-mesh/curfew/mesh/apikey"
)

// Parse never panics and accepts only what has a key's shape; Redact never panics,
// leaves text without a key alone, and leaves no well-formed key in its output, wherever
// keys sit in the text.
func FuzzParseAndRedact(f *testing.F) {
	k, _ := apikey.New("acme")
	for _, s := range []string{k.Secret, "Bearer " + k.Secret, k.Secret + k.Secret, "cfk_", "cfk_cfk_" + k.Secret[4:],
		"x" + k.Secret[:len(k.Secret)-1], "error: key " + k.Secret + " refused", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if id, secret, err := apikey.Parse(s); err == nil {
			if s != apikey.Prefix+id+"_"+secret || apikey.ID(s) != id {
				t.Fatalf("Parse(%q) = %q, %q: not the key's parts", s, id, secret)
			}
		}
		out := apikey.Redact(s)
		if !strings.Contains(s, apikey.Prefix) && out != s {
			t.Fatalf("Redact(%q) = %q: text without a key changed", s, out)
		}
		// No well-formed key is left anywhere in the output.
		n := len(k.Secret)
		for i := 0; i+n <= len(out); i++ {
			if _, _, err := apikey.Parse(out[i : i+n]); err == nil {
				t.Fatalf("Redact(%q) = %q still holds the key %q", s, out, out[i:i+n])
			}
		}
	})
}
