package tinygguf

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// file is what the minimal reader below makes of a GGUF file.
type file struct {
	version  uint32
	kv       map[string]any
	keys     []string // in file order
	tensors  []tensorInfo
	dataBase uint64 // offset of the data section
	size     int
}

type tensorInfo struct {
	name   string
	dims   []uint64
	typ    uint32
	offset uint64 // relative to dataBase
	data   []float32
}

// parse is an independent reader of the GGUF v3 layout (ggml's docs/gguf.md), written from
// the spec rather than from the writer.
func parse(b []byte) (*file, error) {
	r := &reader{b: b}
	if string(r.bytes(4)) != "GGUF" {
		return nil, errors.New("bad magic")
	}
	f := &file{kv: map[string]any{}, size: len(b)}
	f.version = r.u32()
	nt, nkv := r.u64(), r.u64()
	for range nkv {
		k := r.str()
		f.keys = append(f.keys, k)
		f.kv[k] = r.value(r.u32())
	}
	for range nt {
		t := tensorInfo{name: r.str()}
		nd := r.u32()
		for range nd {
			t.dims = append(t.dims, r.u64())
		}
		t.typ = r.u32()
		t.offset = r.u64()
		f.tensors = append(f.tensors, t)
	}
	alignment := uint64(32)
	if a, ok := f.kv["general.alignment"].(uint32); ok {
		alignment = uint64(a)
	}
	f.dataBase = (r.off + alignment - 1) / alignment * alignment
	for i := range f.tensors {
		t := &f.tensors[i]
		n := uint64(1)
		for _, d := range t.dims {
			n *= d
		}
		start := f.dataBase + t.offset
		if t.typ != 0 || start+4*n > uint64(len(b)) {
			return nil, fmt.Errorf("tensor %s: type %d, end %d past %d", t.name, t.typ, start+4*n, len(b))
		}
		t.data = make([]float32, n)
		for j := range t.data {
			t.data[j] = math.Float32frombits(binary.LittleEndian.Uint32(b[start+4*uint64(j):]))
		}
	}
	return f, r.err
}

type reader struct {
	b   []byte
	off uint64
	err error
}

func (r *reader) bytes(n uint64) []byte {
	if r.err != nil || r.off+n > uint64(len(r.b)) {
		if r.err == nil {
			r.err = errors.New("short file")
		}
		return make([]byte, n)
	}
	out := r.b[r.off : r.off+n]
	r.off += n
	return out
}
func (r *reader) u32() uint32 { return binary.LittleEndian.Uint32(r.bytes(4)) }
func (r *reader) u64() uint64 { return binary.LittleEndian.Uint64(r.bytes(8)) }
func (r *reader) str() string { return string(r.bytes(r.u64())) }

func (r *reader) value(typ uint32) any {
	switch typ {
	case 4:
		return r.u32()
	case 5:
		return int32(r.u32()) //nolint:gosec // GGUF int32
	case 6:
		return math.Float32frombits(r.u32())
	case 7:
		return r.bytes(1)[0] != 0
	case 8:
		return r.str()
	case 9:
		et, n := r.u32(), r.u64()
		out := make([]any, 0, n)
		for range n {
			out = append(out, r.value(et))
		}
		return out
	default:
		r.err = fmt.Errorf("unexpected value type %d", typ)
		return nil
	}
}

func write(t *testing.T, c Config) []byte {
	t.Helper()
	var buf bytes.Buffer
	if err := Write(&buf, c); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func TestLayout(t *testing.T) {
	b := write(t, Config{})
	f, err := parse(b)
	if err != nil {
		t.Fatal(err)
	}
	if f.version != 3 {
		t.Errorf("version %d, want 3", f.version)
	}
	if f.size < 100<<10 || f.size > 1<<20 {
		t.Errorf("size %d bytes, want a few hundred KB", f.size)
	}
	t.Logf("%d bytes, %d tensors", f.size, len(f.tensors))
	if f.keys[0] != "general.architecture" || f.kv["general.architecture"] != "llama" {
		t.Errorf("general.architecture must come first and be llama: %v", f.keys[0])
	}
	c := Default()
	wantU32 := map[string]uint32{
		"llama.context_length":          uint32(c.ContextLength),
		"llama.embedding_length":        uint32(c.Embed),
		"llama.block_count":             uint32(c.Blocks),
		"llama.feed_forward_length":     uint32(c.FeedForward),
		"llama.attention.head_count":    uint32(c.Heads),
		"llama.attention.head_count_kv": uint32(c.Heads),
		"llama.rope.dimension_count":    uint32(c.Embed / c.Heads),
		"tokenizer.ggml.bos_token_id":   BOSID,
		"tokenizer.ggml.eos_token_id":   EOSID,
		"general.alignment":             Alignment,
	}
	for k, want := range wantU32 {
		if got, ok := f.kv[k].(uint32); !ok || got != want {
			t.Errorf("%s = %#v, want uint32 %d", k, f.kv[k], want)
		}
	}
	if eps, ok := f.kv["llama.attention.layer_norm_rms_epsilon"].(float32); !ok || eps <= 0 {
		t.Errorf("layer_norm_rms_epsilon = %#v", f.kv["llama.attention.layer_norm_rms_epsilon"])
	}
	if f.kv["tokenizer.ggml.model"] != "llama" {
		t.Errorf("tokenizer.ggml.model = %v", f.kv["tokenizer.ggml.model"])
	}

	// Vocabulary: unique tokens (llama.cpp asserts it), scores and types per token, the
	// special tokens where the ids say, and every byte token (SentencePiece byte fallback
	// and the newline token).
	toks, _ := f.kv["tokenizer.ggml.tokens"].([]any)
	scores, _ := f.kv["tokenizer.ggml.scores"].([]any)
	types, _ := f.kv["tokenizer.ggml.token_type"].([]any)
	if len(toks) == 0 || len(scores) != len(toks) || len(types) != len(toks) {
		t.Fatalf("tokens %d, scores %d, types %d", len(toks), len(scores), len(types))
	}
	if f.kv["llama.vocab_size"] != uint32(len(toks)) {
		t.Errorf("vocab_size %v, tokens %d", f.kv["llama.vocab_size"], len(toks))
	}
	seen := map[string]bool{}
	for i, tok := range toks {
		s := tok.(string)
		if seen[s] {
			t.Errorf("duplicate token %q", s)
		}
		seen[s] = true
		if _, ok := scores[i].(float32); !ok {
			t.Errorf("score %d is %T", i, scores[i])
		}
		if _, ok := types[i].(int32); !ok {
			t.Errorf("type %d is %T", i, types[i])
		}
	}
	if toks[BOSID] != "<s>" || toks[EOSID] != "</s>" || types[EOSID] != int32(TokenControl) {
		t.Errorf("special tokens: bos %v eos %v (type %v)", toks[BOSID], toks[EOSID], types[EOSID])
	}
	for b := range 256 {
		if !seen[fmt.Sprintf("<0x%02X>", b)] {
			t.Errorf("byte token <0x%02X> missing", b)
		}
	}

	// Tensors: names and shapes as llama.cpp's LLM_ARCH_LLAMA loader creates them, each at an
	// aligned offset, back to back without overlap.
	d, ff, v := uint64(c.Embed), uint64(c.FeedForward), uint64(len(toks))
	want := map[string][]uint64{
		"token_embd.weight":  {d, v},
		"output_norm.weight": {d},
		"output.weight":      {d, v},
	}
	for b := range c.Blocks {
		p := fmt.Sprintf("blk.%d.", b)
		for _, n := range []string{"attn_norm", "ffn_norm"} {
			want[p+n+".weight"] = []uint64{d}
		}
		for _, n := range []string{"attn_q", "attn_k", "attn_v", "attn_output"} {
			want[p+n+".weight"] = []uint64{d, d}
		}
		want[p+"ffn_gate.weight"] = []uint64{d, ff}
		want[p+"ffn_up.weight"] = []uint64{d, ff}
		want[p+"ffn_down.weight"] = []uint64{ff, d}
	}
	if len(f.tensors) != len(want) {
		t.Errorf("%d tensors, want %d", len(f.tensors), len(want))
	}
	if f.dataBase%Alignment != 0 {
		t.Errorf("data section at %d, not aligned", f.dataBase)
	}
	var next uint64
	for _, ti := range f.tensors {
		if fmt.Sprint(ti.dims) != fmt.Sprint(want[ti.name]) {
			t.Errorf("%s: dims %v, want %v", ti.name, ti.dims, want[ti.name])
		}
		if ti.offset%Alignment != 0 || ti.offset < next {
			t.Errorf("%s: offset %d (previous tensor ends at %d)", ti.name, ti.offset, next)
		}
		next = ti.offset + 4*uint64(len(ti.data))
		for _, x := range ti.data {
			if math.IsNaN(float64(x)) || math.IsInf(float64(x), 0) {
				t.Fatalf("%s: non-finite weight", ti.name)
			}
		}
	}
	if end := f.dataBase + next; end > uint64(f.size) || uint64(f.size)-end >= Alignment {
		t.Errorf("data ends at %d, file is %d bytes", end, f.size)
	}
}

// TestBiasedAwayFromSpecialTokens checks the property that makes streams run long: the
// logit of every special or byte token is far below every word's. It runs the model
// exactly (llama's forward pass) on each one-token sequence; with one position, attention
// returns the token's own value vector, so RoPE and the softmax drop out. Longer contexts
// mix value vectors of the same size, and no block writes to the bias channel.
func TestBiasedAwayFromSpecialTokens(t *testing.T) {
	f, err := parse(write(t, Config{Seed: 7}))
	if err != nil {
		t.Fatal(err)
	}
	w := map[string][]float32{}
	for _, ti := range f.tensors {
		w[ti.name] = ti.data
	}
	c := Default()
	d := c.Embed
	types := f.kv["tokenizer.ggml.token_type"].([]any)
	for b := range c.Blocks {
		// No block writes to the bias channel: row 0 of both projections into the stream.
		for _, n := range []string{"attn_output", "ffn_down"} {
			m := w[fmt.Sprintf("blk.%d.%s.weight", b, n)]
			for _, x := range m[:len(m)/d] {
				if x != 0 {
					t.Fatalf("blk.%d.%s writes to the bias channel", b, n)
				}
			}
		}
	}
	// matvec: m has rows of len(x) values.
	matvec := func(m, x []float32) []float32 {
		out := make([]float32, len(m)/len(x))
		for o := range out {
			var s float32
			for i, v := range x {
				s += m[o*len(x)+i] * v
			}
			out[o] = s
		}
		return out
	}
	norm := func(x, g []float32) []float32 {
		var ss float64
		for _, v := range x {
			ss += float64(v) * float64(v)
		}
		r := float32(1 / math.Sqrt(ss/float64(len(x))+1e-5))
		out := make([]float32, len(x))
		for i, v := range x {
			out[i] = v * r * g[i]
		}
		return out
	}
	add := func(x, y []float32) {
		for i := range x {
			x[i] += y[i]
		}
	}
	worst := float32(math.Inf(-1)) // highest special logit minus lowest word logit
	var residual float64           // largest |x_i| the blocks added to the stream
	for tok := range len(types) {
		x := append([]float32(nil), w["token_embd.weight"][tok*d:(tok+1)*d]...)
		x0 := append([]float32(nil), x...)
		for b := range c.Blocks {
			p := fmt.Sprintf("blk.%d.", b)
			xn := norm(x, w[p+"attn_norm.weight"])
			add(x, matvec(w[p+"attn_output.weight"], matvec(w[p+"attn_v.weight"], xn))) // Heads == HeadsKV
			xn = norm(x, w[p+"ffn_norm.weight"])
			g, u := matvec(w[p+"ffn_gate.weight"], xn), matvec(w[p+"ffn_up.weight"], xn)
			for i := range g {
				g[i] = g[i] / (1 + float32(math.Exp(float64(-g[i])))) * u[i] // SiLU(gate)·up
			}
			add(x, matvec(w[p+"ffn_down.weight"], g))
		}
		for i := range x {
			residual = max(residual, math.Abs(float64(x[i]-x0[i])))
		}
		logits := matvec(w["output.weight"], norm(x, w["output_norm.weight"]))
		maxSpecial, minWord := float32(math.Inf(-1)), float32(math.Inf(1))
		for v, l := range logits {
			if Special(types[v].(int32)) {
				maxSpecial = max(maxSpecial, l)
			} else {
				minWord = min(minWord, l)
			}
		}
		worst = max(worst, maxSpecial-minWord)
	}
	if worst > -20 {
		t.Errorf("a special token's logit is only %.1f below a word's; want at least 20", -worst)
	}
	t.Logf("special tokens sit at least %.1f logits below every word; the %d blocks move the stream by at most %.2f",
		-worst, c.Blocks, residual)
}

func TestDeterministic(t *testing.T) {
	a, b := write(t, Config{Seed: 3}), write(t, Config{Seed: 3})
	if !bytes.Equal(a, b) {
		t.Error("same seed, different files")
	}
	if bytes.Equal(a, write(t, Config{Seed: 4})) {
		t.Error("different seeds, same file")
	}
	path := filepath.Join(t.TempDir(), "m.gguf")
	if err := WriteFile(path, Config{Seed: 3}); err != nil {
		t.Fatal(err)
	}
	if got, err := os.ReadFile(path); err != nil || !bytes.Equal(got, a) {
		t.Errorf("WriteFile differs from Write (err %v)", err)
	}
}

func TestInvalidConfig(t *testing.T) {
	for _, c := range []Config{{HeadDim: 3}, {Heads: 4, HeadsKV: 3}, {Embed: 4}} {
		if err := Write(&bytes.Buffer{}, c); err == nil {
			t.Errorf("%+v: no error", c)
		}
	}
}
