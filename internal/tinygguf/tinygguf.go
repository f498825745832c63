// Package tinygguf writes a tiny random-weight llama-architecture model in the GGUF format,
// so that tests can run a real inference server (llama.cpp, ollama) without downloading a
// model: no package registry ships one.
//
// The file follows the documented GGUF v3 layout (ggml's docs/gguf.md): the magic "GGUF",
// version 3, the tensor and key-value counts, the key-value pairs, the tensor infos, padding
// to general.alignment, then the tensor data, each tensor at an aligned offset. The keys and
// tensor names are those llama.cpp's loader reads for LLM_ARCH_LLAMA with a "llama"
// (SentencePiece) tokenizer: <unk>, <s>, </s>, the 256 byte tokens <0x00>…<0xFF> (so that any
// prompt tokenizes, and the newline token exists), then plain word pieces.
//
// The weights are random (deterministic from Config.Seed), so the model writes word salad.
// It is built to write a lot of it: channel 0 of the residual stream is a constant "bias
// channel" (every token embedding has Bias there, and no block writes to it), and the output
// rows of the special and byte tokens weigh that channel with a large negative value, so
// their logits sit tens of units below every word's. A stream therefore never samples
// end-of-text and runs until the client stops it or max_tokens is reached, and every token
// decodes to valid UTF-8 text.
package tinygguf

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"strings"
)

// Token types of tokenizer.ggml.token_type (llama.cpp's llama_token_type).
const (
	TokenNormal      = 1
	TokenUnknown     = 2
	TokenControl     = 3
	TokenUserDefined = 4
	TokenUnused      = 5
	TokenByte        = 6
)

// Special token ids (SentencePiece's defaults, also written as metadata).
const (
	UnkID = 0
	BOSID = 1
	EOSID = 2
)

// Alignment is general.alignment: every tensor's data starts at a multiple of it.
const Alignment = 32

// Config shapes the model. The zero value of a field means its default (see Default).
type Config struct {
	Seed          uint64  // weights are a pure function of the config, seed included
	Embed         int     // llama.embedding_length (default 8)
	Blocks        int     // llama.block_count (default 256)
	Heads         int     // llama.attention.head_count (default 1)
	HeadsKV       int     // llama.attention.head_count_kv (default Heads)
	HeadDim       int     // llama.attention.key_length = value_length (default Embed/Heads)
	FeedForward   int     // llama.feed_forward_length (default 8)
	ContextLength int     // llama.context_length (default 4096)
	Bias          float32 // the bias channel's value in every embedding (default 1)
	SpecialWeight float32 // how strongly special/byte tokens are pushed down (default 30)
	Name          string  // general.name (default "curfew-tiny")
}

// Default returns the configuration Write uses for zero fields: about 650 KB.
//
// It is deep and narrow on purpose: 256 blocks of width 8. The weights stay tiny, but each
// token still runs a graph of a few thousand operations, so llama.cpp on one thread
// decodes at the rate of a real model (measured on the 2-core CI machine: about 200
// tokens/s early in a stream, 100 by its thousandth token), not thousands of tokens per
// second. Per-token bounds ("at most one token after a cancel") then mean what they mean
// for a real model.
func Default() Config {
	return Config{
		Seed: 1, Embed: 8, Blocks: 256, Heads: 1, FeedForward: 8, ContextLength: 4096,
		Bias: 1, SpecialWeight: 30, Name: "curfew-tiny",
	}
}

func (c Config) withDefaults() Config {
	d := Default()
	if c.Embed == 0 {
		c.Embed = d.Embed
	}
	if c.Blocks == 0 {
		c.Blocks = d.Blocks
	}
	if c.Heads == 0 {
		c.Heads = d.Heads
	}
	if c.HeadsKV == 0 {
		c.HeadsKV = c.Heads
	}
	if c.HeadDim == 0 {
		c.HeadDim = c.Embed / c.Heads
	}
	if c.FeedForward == 0 {
		c.FeedForward = d.FeedForward
	}
	if c.ContextLength == 0 {
		c.ContextLength = d.ContextLength
	}
	if c.Bias == 0 {
		c.Bias = d.Bias
	}
	if c.SpecialWeight == 0 {
		c.SpecialWeight = d.SpecialWeight
	}
	if c.Name == "" {
		c.Name = d.Name
	}
	return c
}

func (c Config) validate() error {
	switch {
	case c.Embed < 8 || c.Blocks < 1 || c.Heads < 1 || c.FeedForward < 1 || c.ContextLength < 16:
		return fmt.Errorf("tinygguf: sizes too small: %+v", c)
	case c.Heads%c.HeadsKV != 0:
		return fmt.Errorf("tinygguf: heads %d is not a multiple of heads_kv %d", c.Heads, c.HeadsKV)
	case c.HeadDim < 2 || c.HeadDim%2 != 0:
		return fmt.Errorf("tinygguf: head size %d must be even (RoPE)", c.HeadDim)
	}
	return nil
}

// words are the vocabulary's word pieces besides the letters; "▁" marks a leading space,
// as in SentencePiece.
var words = []string{
	"the", "a", "of", "and", "to", "in", "is", "that", "it", "for", "on", "with", "as", "was",
	"at", "by", "from", "this", "be", "or", "an", "are", "not", "but", "we", "can", "all",
	"one", "will", "run", "stop", "time", "mesh", "node", "tree", "agent", "model", "tool",
	"call", "token", "stream", "cancel", "deadline", "curfew", "retry", "break", "signal",
	"proxy", "server", "client", "clock", "leaf", "root", "queue", "budget", "plan", "step",
	"think", "answer", "fast", "slow", "late", "early", "night", "day", "light", "quiet",
	"bell", "gate", "door", "road", "city", "river", "stone", "wind", "rain", "snow", "fire",
	"water", "green", "blue", "red", "small", "large", "new", "old", "first", "last", "next",
	"over", "under", "again", "still", "soon", "now", "then",
}

// Vocab returns the tokens, their scores and their types, in id order.
func Vocab() (tokens []string, scores []float32, types []int32) {
	add := func(tok string, score float32, typ int32) {
		tokens = append(tokens, tok)
		scores = append(scores, score)
		types = append(types, typ)
	}
	add("<unk>", 0, TokenUnknown)
	add("<s>", 0, TokenControl)
	add("</s>", 0, TokenControl)
	for b := range 256 {
		add(fmt.Sprintf("<0x%02X>", b), 0, TokenByte)
	}
	// Scores rank SentencePiece merges: longer pieces first.
	add("▁", -1000, TokenNormal)
	for ch := 'a'; ch <= 'z'; ch++ {
		add(string(ch), -1000, TokenNormal)
	}
	for i, w := range words {
		add("▁"+w, -float32(i), TokenNormal)
	}
	return tokens, scores, types
}

// Special reports whether the model is built never to emit the token: control, unknown and
// byte tokens.
func Special(tokenType int32) bool { return tokenType != TokenNormal }

// Write writes the model to w.
func Write(w io.Writer, c Config) error {
	c = c.withDefaults()
	if err := c.validate(); err != nil {
		return err
	}
	tokens, scores, types := Vocab()
	kvs := metadata(c, tokens, scores, types)
	tensors := weights(c, types)

	bw := bufio.NewWriter(w)
	e := &enc{w: bw}
	e.raw([]byte("GGUF"))
	e.u32(3)
	e.u64(uint64(len(tensors)))
	e.u64(uint64(len(kvs)))
	for _, kv := range kvs {
		e.str(kv.key)
		e.value(kv.value)
	}
	var offset uint64
	for _, t := range tensors {
		e.str(t.name)
		e.u32(uint32(len(t.dims)))
		for _, d := range t.dims {
			e.u64(d)
		}
		e.u32(0) // GGML_TYPE_F32
		e.u64(offset)
		offset = align(offset + uint64(4*len(t.data)))
	}
	e.pad()
	for _, t := range tensors {
		for _, f := range t.data {
			e.u32(math.Float32bits(f))
		}
		e.pad()
	}
	if e.err != nil {
		return e.err
	}
	return bw.Flush()
}

// WriteFile writes the model to path.
func WriteFile(path string, c Config) (err error) {
	f, err := os.Create(path) //nolint:gosec // the caller names the file
	if err != nil {
		return err
	}
	defer func() {
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	}()
	return Write(f, c)
}

type kv struct {
	key   string
	value any // uint32, float32, string, bool, []string, []float32, []int32
}

func metadata(c Config, tokens []string, scores []float32, types []int32) []kv {
	return []kv{
		{"general.architecture", "llama"},
		{"general.name", c.Name},
		{"general.file_type", uint32(0)}, // LLAMA_FTYPE_ALL_F32
		{"general.alignment", uint32(Alignment)},
		{"llama.context_length", uint32(c.ContextLength)},
		{"llama.embedding_length", uint32(c.Embed)},
		{"llama.block_count", uint32(c.Blocks)},
		{"llama.feed_forward_length", uint32(c.FeedForward)},
		{"llama.attention.head_count", uint32(c.Heads)},
		{"llama.attention.head_count_kv", uint32(c.HeadsKV)},
		{"llama.attention.key_length", uint32(c.HeadDim)},
		{"llama.attention.value_length", uint32(c.HeadDim)},
		{"llama.rope.dimension_count", uint32(c.HeadDim)}, // llama.cpp wants it equal to key_length
		{"llama.rope.freq_base", float32(10000)},
		{"llama.attention.layer_norm_rms_epsilon", float32(1e-5)},
		{"llama.vocab_size", uint32(len(tokens))},
		{"tokenizer.ggml.model", "llama"},
		{"tokenizer.ggml.tokens", tokens},
		{"tokenizer.ggml.scores", scores},
		{"tokenizer.ggml.token_type", types},
		{"tokenizer.ggml.bos_token_id", uint32(BOSID)},
		{"tokenizer.ggml.eos_token_id", uint32(EOSID)},
		{"tokenizer.ggml.unknown_token_id", uint32(UnkID)},
		{"tokenizer.ggml.add_bos_token", true},
		{"tokenizer.ggml.add_eos_token", false},
	}
}

type tensor struct {
	name string
	dims []uint64 // ne0 first: ne0 is the contiguous (row) dimension
	data []float32
}

// weights builds the tensors. A tensor with dims {in, out} holds out rows of in values;
// llama.cpp computes y[o] = Σ_i W[o][i]·x[i].
func weights(c Config, types []int32) []tensor {
	rng := rand.New(rand.NewPCG(c.Seed, c.Seed^0x9e3779b97f4a7c15)) //nolint:gosec // weights, not secrets
	vocab := len(types)
	d := c.Embed
	qDim := c.HeadDim * c.Heads
	kvDim := c.HeadDim * c.HeadsKV
	randn := func(n int, std float64) []float32 {
		out := make([]float32, n)
		for i := range out {
			out[i] = float32(rng.NormFloat64() * std)
		}
		return out
	}
	ones := func(n int) []float32 {
		out := make([]float32, n)
		for i := range out {
			out[i] = 1
		}
		return out
	}
	// zeroRow0 keeps a projection into the residual stream off the bias channel.
	zeroRow0 := func(w []float32, in int) []float32 {
		clear(w[:in])
		return w
	}

	embd := randn(vocab*d, 0.1)
	for v := range vocab {
		embd[v*d] = c.Bias
	}
	ts := []tensor{{"token_embd.weight", []uint64{uint64(d), uint64(vocab)}, embd}}
	inScale := 1 / math.Sqrt(float64(d))
	// The projections back into the residual stream shrink with depth, so that the sum of
	// all blocks' contributions stays below the embedding's and the bias channel dominates
	// the final norm.
	outScale := 0.1 / math.Sqrt(float64(c.Blocks))
	for b := range c.Blocks {
		p := fmt.Sprintf("blk.%d.", b)
		ts = append(ts,
			tensor{p + "attn_norm.weight", []uint64{uint64(d)}, ones(d)},
			tensor{p + "attn_q.weight", []uint64{uint64(d), uint64(qDim)}, randn(qDim*d, inScale)},
			tensor{p + "attn_k.weight", []uint64{uint64(d), uint64(kvDim)}, randn(kvDim*d, inScale)},
			tensor{p + "attn_v.weight", []uint64{uint64(d), uint64(kvDim)}, randn(kvDim*d, inScale)},
			tensor{p + "attn_output.weight", []uint64{uint64(qDim), uint64(d)}, zeroRow0(randn(d*qDim, outScale), qDim)},
			tensor{p + "ffn_norm.weight", []uint64{uint64(d)}, ones(d)},
			tensor{p + "ffn_gate.weight", []uint64{uint64(d), uint64(c.FeedForward)}, randn(c.FeedForward*d, inScale)},
			tensor{p + "ffn_up.weight", []uint64{uint64(d), uint64(c.FeedForward)}, randn(c.FeedForward*d, inScale)},
			tensor{p + "ffn_down.weight", []uint64{uint64(c.FeedForward), uint64(d)},
				zeroRow0(randn(d*c.FeedForward, outScale), c.FeedForward)},
		)
	}
	out := randn(vocab*d, 0.3)
	for v := range vocab {
		row := out[v*d : (v+1)*d]
		if Special(types[v]) {
			clear(row)
			row[0] = -c.SpecialWeight
		} else {
			row[0] = 0
		}
	}
	ts = append(ts,
		tensor{"output_norm.weight", []uint64{uint64(d)}, ones(d)},
		tensor{"output.weight", []uint64{uint64(d), uint64(vocab)}, out},
	)
	return ts
}

func align(n uint64) uint64 { return (n + Alignment - 1) / Alignment * Alignment }

// GGUF value types (gguf_type).
const (
	typeUint32  = 4
	typeInt32   = 5
	typeFloat32 = 6
	typeBool    = 7
	typeString  = 8
	typeArray   = 9
)

// enc writes little-endian GGUF and keeps the first error.
type enc struct {
	w   io.Writer
	n   uint64
	err error
}

func (e *enc) raw(b []byte) {
	if e.err != nil {
		return
	}
	var n int
	n, e.err = e.w.Write(b)
	e.n += uint64(n)
}

func (e *enc) u32(v uint32) { e.raw(binary.LittleEndian.AppendUint32(nil, v)) }
func (e *enc) u64(v uint64) { e.raw(binary.LittleEndian.AppendUint64(nil, v)) }
func (e *enc) str(s string) { e.u64(uint64(len(s))); e.raw([]byte(s)) }
func (e *enc) pad()         { e.raw(make([]byte, align(e.n)-e.n)) }

func (e *enc) value(v any) {
	switch v := v.(type) {
	case uint32:
		e.u32(typeUint32)
		e.u32(v)
	case float32:
		e.u32(typeFloat32)
		e.u32(math.Float32bits(v))
	case bool:
		e.u32(typeBool)
		if v {
			e.raw([]byte{1})
		} else {
			e.raw([]byte{0})
		}
	case string:
		e.u32(typeString)
		e.str(v)
	case []string:
		e.u32(typeArray)
		e.u32(typeString)
		e.u64(uint64(len(v)))
		for _, s := range v {
			e.str(s)
		}
	case []float32:
		e.u32(typeArray)
		e.u32(typeFloat32)
		e.u64(uint64(len(v)))
		for _, f := range v {
			e.u32(math.Float32bits(f))
		}
	case []int32:
		e.u32(typeArray)
		e.u32(typeInt32)
		e.u64(uint64(len(v)))
		for _, i := range v {
			e.u32(uint32(i)) //nolint:gosec // two's complement, as GGUF stores int32
		}
	default:
		if e.err == nil {
			e.err = errors.New("tinygguf: unsupported metadata value " + strings.TrimSpace(fmt.Sprintf("%T", v)))
		}
	}
}
