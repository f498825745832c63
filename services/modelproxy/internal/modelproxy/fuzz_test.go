package modelproxy

import "testing"

// FuzzParseFile: a --providers-config file is refused with an error or validates; it
// never crashes modelproxy at start. Target names (provider/model) are fuzzed on their own.
func FuzzParseFile(f *testing.F) {
	f.Add([]byte(`{"providers": [{"name": "local", "base_url": "http://127.0.0.1:11434/v1", "models": ["llama3.2"]}], "models": {"agent": {"chain": ["local/llama3.2"]}}}`))
	f.Add([]byte(`{"providers": [{"name": "openai", "base_url": "https://api.openai.com/v1", "api_key_env": "OPENAI_API_KEY", "models": ["gpt-4.1-mini"]}], "models": {"a": {"chain": ["openai/gpt-4.1-mini"], "cache_ttl": "1m"}}}`))
	f.Add([]byte(`{"providers": [], "models": {}}`))
	f.Add([]byte(`{"providers": [{"name": "x", "base_url": "ftp://x"}]}`))
	f.Add([]byte(`{"models": {"a": {"chain": ["nope/x"]}}}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		file, err := ParseFile(data)
		if err != nil {
			return
		}
		if err := file.Validate(); err != nil {
			t.Fatalf("ParseFile accepted a file that does not validate: %v", err)
		}
	})
}

func FuzzParseTarget(f *testing.F) {
	for _, s := range []string{"local/llama3.2", "openai/gpt-4.1-mini", "/", "a/", "/b", "a/b/c", "", "sim"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		tg, err := ParseTarget(s)
		if err != nil {
			return
		}
		if tg.Provider == "" || tg.Model == "" || tg.String() != s {
			t.Fatalf("ParseTarget(%q) = %+v", s, tg)
		}
	})
}
