package modelproxy

import (
	"crypto/sha256"
	"time"

	lru "github.com/hashicorp/golang-lru/v2"
	"google.golang.org/protobuf/proto"

	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
)

// Cache answers identical requests from an earlier answer: the provider chain, model,
// messages, tools and parameters all equal, within the TTL. Only requests that are
// deterministic (temperature set to 0) or marked cacheable (by the request or by the
// alias) are cached, and only complete, valid answers.
//
// It is an LRU of bounded size whose entries expire on read; the library's expirable LRU
// is not used because it runs a goroutine per cache that nothing can stop.
type Cache struct {
	lru *lru.Cache[[sha256.Size]byte, *cached]
	ttl time.Duration
	now func() time.Time
}

// cached is one stored answer.
type cached struct {
	text         string
	toolCalls    []*modelproxyv1.ToolCall
	finishReason string
	usage        *modelproxyv1.Usage
	provider     string
	model        string
	expires      time.Time
}

// NewCache returns a cache of at most maxEntries answers, each kept for ttl.
func NewCache(maxEntries int, ttl time.Duration) *Cache {
	l, err := lru.New[[sha256.Size]byte, *cached](max(maxEntries, 1))
	if err != nil {
		panic(err) // only for a size below 1
	}
	return &Cache{lru: l, ttl: ttl, now: time.Now}
}

// cacheable reports whether req may be answered from the cache.
func cacheable(req *modelproxyv1.GenerateRequest, alias *AliasConfig) bool {
	if req.Cacheable || (alias != nil && alias.Cacheable) {
		return true
	}
	return req.Temperature != nil && req.GetTemperature() == 0
}

// cacheKey hashes everything that shapes the answer. The model string is the alias or
// provider/model as requested: the alias's chain is fixed for the process's life.
func cacheKey(req *modelproxyv1.GenerateRequest) ([sha256.Size]byte, error) {
	k := proto.Clone(req).(*modelproxyv1.GenerateRequest)
	k.Cacheable = false // the mark does not shape the answer
	// The time-left note changes from call to call while the answer it asks for does not:
	// keyed on it, a cache would never hit (GenerateRequest.notes).
	k.Notes = nil
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(k)
	if err != nil {
		return [sha256.Size]byte{}, err
	}
	return sha256.Sum256(b), nil
}

func (c *Cache) get(k [sha256.Size]byte) (*cached, bool) {
	v, ok := c.lru.Get(k)
	if !ok {
		return nil, false
	}
	if !c.now().Before(v.expires) {
		c.lru.Remove(k)
		return nil, false
	}
	return v, true
}

func (c *Cache) put(k [sha256.Size]byte, v *cached) {
	v.expires = c.now().Add(c.ttl)
	c.lru.Add(k, v)
}

// Len returns the number of answers held.
func (c *Cache) Len() int { return c.lru.Len() }
