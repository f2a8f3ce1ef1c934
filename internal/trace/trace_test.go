package trace

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// published is the path of a trace of ../shared/traces, as the repository's neighbour holds it
// (CI's clone has it beside; a checkout without it skips, saying so, outside CI).
func published(t *testing.T, name string) string {
	t.Helper()
	p := filepath.Join("..", "..", "..", "shared", "traces", name)
	if _, err := os.Stat(p); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("the published trace %s is not beside the repository: %v", name, err)
		}
		t.Skipf("SKIPPED: the published trace %s is not beside the repository (../shared/traces): %v", name, err)
	}
	return p
}

// Mooncake's conversation trace as published: every request read, and its ceiling with
// unlimited memory the 36.6 % of its prompt blocks its README states.
func TestMooncakeAsPublished(t *testing.T) {
	reqs, err := Open(published(t, "mooncake-conversation.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	if len(reqs) != 12031 {
		t.Fatalf("%d requests, want 12,031", len(reqs))
	}
	if r := reqs[0]; r.At != 0 || r.Input != 6758 || r.Output != 500 || len(r.HashIDs) != 14 {
		t.Errorf("first request %+v", r)
	}
	if c := Ceiling(reqs); c < 0.3664 || c > 0.3665 {
		t.Errorf("ceiling %.4f, want 0.3664 (36.6 %% of the prompt blocks reusable)", c)
	}
	for i := 1; i < len(reqs); i++ {
		if reqs[i].At < reqs[i-1].At {
			t.Fatalf("request %d arrives before request %d", i, i-1)
		}
	}
	// Its reuse is all prefix: one engine of unlimited memory finds the whole ceiling; four
	// engines of bounded memory find less, and more with more memory.
	if o := Oracle(reqs, 1, 1<<30); o < 0.3664 || o > 0.3665 {
		t.Errorf("one engine of unlimited memory: %.4f, want the ceiling 0.3664", o)
	}
	if small, large := Oracle(reqs, 4, 6000), Oracle(reqs, 4, 20000); small >= large || large >= 0.3664 || small <= 0 {
		t.Errorf("four engines of 6,000 and 20,000 blocks: %.4f and %.4f", small, large)
	}
}

// Azure's conversation trace as published: every request, its times from the first request's,
// and no prefixes.
func TestAzureAsPublished(t *testing.T) {
	reqs, err := Open(published(t, "azure-2023-conv.csv"))
	if err != nil {
		t.Fatal(err)
	}
	if len(reqs) != 19366 {
		t.Fatalf("%d requests, want 19,366", len(reqs))
	}
	first, last := reqs[0], reqs[len(reqs)-1]
	if first.At != 0 || first.Input != 374 || first.Output != 44 || last.Input != 197 || last.Output != 183 {
		t.Errorf("first %+v, last %+v", first, last)
	}
	// 18:15:46.6805900 to 19:14:08.4025270
	if want := 58*time.Minute + 21*time.Second + 721937*time.Microsecond; last.At != want {
		t.Errorf("last at %v, want %v", last.At, want)
	}
	if Ceiling(reqs) != 0 {
		t.Error("Azure's trace has no prefixes: its ceiling is 0")
	}
}

// A line that is not the published format is an error naming the file and the line.
func TestMalformedLinesAreNamed(t *testing.T) {
	good := `{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}` + "\n"
	for _, c := range []struct{ body, want string }{
		{good + `{"timestamp": 1, "input_length": 600, "output_length": 5}`, "t.jsonl:2: "},
		{good + `{"timestamp": 1, "input_length": 600, "output_length": 5, "hash_ids": [0], "extra": 1}`, "t.jsonl:2: "},
		{good + "\n" + `{"timestamp": 1, "input_length": 600, "output_length": 5, "hash_ids": [0, 1, 2]}`, "t.jsonl:3: "},
		{good + `{"timestamp": -1, "input_length": 600, "output_length": 5, "hash_ids": []}`, "t.jsonl:2: "},
		{good + `{"timestamp": 1, "input_length": 0, "output_length": 5, "hash_ids": []}`, "t.jsonl:2: "},
		{good + `{"timestamp": 1, "input_length": 600, "output_length": 5, "hash_ids": [-3]}`, "t.jsonl:2: "},
		{good + `{"timestamp": 1, "input_length": 600, "output_length": 5, "hash_ids": [0]} {}`, "t.jsonl:2: "},
		{good + `not json`, "t.jsonl:2: "},
		{good + `{"timestamp": "1", "input_length": 600, "output_length": 5, "hash_ids": []}`, "t.jsonl:2: "},
		{good + `{"timestamp": 1, "input_length": 600, "output_length": 5, "hash_ids": [0]` + strings.Repeat(" ", MaxLineBytes) + "}", "t.jsonl:2: "},
	} {
		_, err := ReadMooncake(strings.NewReader(c.body), "t.jsonl")
		if err == nil || !errors.Is(err, ErrFormat) || !strings.HasPrefix(err.Error(), c.want) {
			t.Errorf("%.80q: %v, want an error beginning %q", c.body, err, c.want)
		}
	}
	head := "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
	for _, c := range []struct{ body, want string }{
		{"TIMESTAMP,Context,GeneratedTokens\n", "t.csv:1: "},
		{head + "2023-11-16 18:15:47,12\n", "t.csv:3: "},
		{head + "yesterday,12,3\n", "t.csv:3: "},
		{head + "2023-11-16 18:15:47.1,-1,3\n", "t.csv:3: "},
		{head + "2023-11-16 18:15:47.1,12,x\n", "t.csv:3: "},
		{head + "2023-11-16 18:15:45.1,12,3\n", "t.csv:3: "},
	} {
		_, err := ReadAzure(strings.NewReader(c.body), "t.csv")
		if err == nil || !errors.Is(err, ErrFormat) || !strings.HasPrefix(err.Error(), c.want) {
			t.Errorf("%q: %v, want an error beginning %q", c.body, err, c.want)
		}
	}
	if _, err := Open("trace.txt"); err == nil {
		t.Error("a file of no known format was read")
	}
}

// The same trace always gives the same prompts, one word a token; a block id is the same words
// in every request that holds it, so a prefix cache sees the trace's own reuse; the rest of a
// prompt is its own.
func TestPromptsKeepTheTracesReuse(t *testing.T) {
	a := Request{Input: 1100, HashIDs: []int64{7, 8, 9}}
	b := Request{Input: 1300, HashIDs: []int64{7, 8, 10}}
	pa, pb := Prompt(a, 0), Prompt(b, 1)
	if pa != Prompt(a, 0) {
		t.Fatal("the same request gave two prompts")
	}
	wa, wb := strings.Fields(pa), strings.Fields(pb)
	if len(wa) != a.Input || len(wb) != b.Input {
		t.Fatalf("%d and %d words for %d and %d tokens", len(wa), len(wb), a.Input, b.Input)
	}
	shared := 0
	for shared < len(wa) && wa[shared] == wb[shared] {
		shared++
	}
	if shared != 2*BlockTokens {
		t.Errorf("the prompts share %d words, want their two common blocks' %d", shared, 2*BlockTokens)
	}
	// Scaled, a block is fewer tokens and its reuse is kept.
	s := Scale([]Request{a, b, {At: 8 * time.Second, Input: 100, Output: 80}}, Scaling{Compress: 8, TokenScale: 8, Limit: 3})
	sa, sb := strings.Fields(Prompt(s[0], 0)), strings.Fields(Prompt(s[1], 1))
	if len(sa) != 1100/8 || s[0].BlockSize() != 64 || s[2].At != time.Second || s[2].Output != 10 {
		t.Errorf("scaled: %d words, blocks of %d, at %v, output %d", len(sa), s[0].BlockSize(), s[2].At, s[2].Output)
	}
	if strings.Join(sa[:128], " ") != strings.Join(sb[:128], " ") || sa[128] == sb[128] {
		t.Error("scaled prompts do not share exactly their two common blocks")
	}
	if len(Scale([]Request{a, b}, Scaling{Limit: 1})) != 1 {
		t.Error("the limit kept more requests")
	}
}

// The all-knowing router: each request on the engine holding its longest cached prefix, a block
// found only as part of a prefix, engines' caches evicted least recently used.
func TestOracle(t *testing.T) {
	reqs := []Request{
		{HashIDs: []int64{0, 1, 2}},
		{HashIDs: []int64{0, 1, 3}},
		{HashIDs: []int64{4, 5}},
		{HashIDs: []int64{0, 1, 2}},
		{HashIDs: []int64{9, 1, 2}}, // its blocks seen, but not as a prefix
	}
	for _, c := range []struct {
		engines, blocks int
		want            float64
	}{
		{1, 100, 5.0 / 14}, // 0 + 2 + 0 + 3 + 0 of 14 blocks
		{2, 100, 5.0 / 14}, // {4,5} goes to the idle engine; the rest where their prefix is
		{1, 3, 2.0 / 14},   // three blocks: 0,1,3 evicts 2; 4,5 evict 0 and 1
		{3, 1, 0},          // an engine of one block holds a request's last block, never its first
		{0, 100, 0},        // no engine
		{1, 0, 0},          // no memory
	} {
		if got := Oracle(reqs, c.engines, c.blocks); got < c.want-1e-9 || got > c.want+1e-9 {
			t.Errorf("%d engines of %d blocks: %.4f, want %.4f", c.engines, c.blocks, got, c.want)
		}
	}
	if o, u := Oracle(reqs, 1, 1000), Ceiling(reqs); o > u {
		t.Errorf("the oracle %.3f found more than unlimited memory's ceiling %.3f", o, u)
	}
}
