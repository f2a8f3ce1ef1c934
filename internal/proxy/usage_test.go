package proxy

import (
	"strings"
	"testing"

	"github.com/baton-llm/baton/internal/record"
)

// A stream's usage is learnt wherever its reads split it — the "usage" key itself cut between two
// reads included — and a stream holds no tail buffer until it mentions its usage.
func TestAStreamsUsageIsLearntHoweverItsReadsSplitIt(t *testing.T) {
	events := "data: {\"id\":\"cmpl-1\",\"choices\":[{\"text\":\"a\"}]}\n\n" +
		"data: {\"id\":\"cmpl-1\",\"choices\":[{\"text\":\"b\"}]}\n\n"
	last := "data: {\"id\":\"cmpl-1\",\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":2,\"total_tokens\":9}}\n\ndata: [DONE]\n\n"
	stream := events + last
	for size := 1; size <= len(stream); size++ {
		for offset := 0; offset < size && offset < 9; offset++ {
			var tail usageTail
			held := false
			for i := 0; i < len(stream); {
				end := min(len(stream), i+size)
				if i == 0 {
					end = min(len(stream), offset+1)
				}
				tail.keepStream([]byte(stream[i:end]))
				if end <= len(events) && tail.b != nil {
					held = true
				}
				i = end
			}
			rec := &record.Record{}
			tail.done(rec, true)
			if !rec.UsageKnown || rec.Usage.Prompt != 7 || rec.Usage.Completion != 2 {
				t.Fatalf("reads of %d (first %d): usage %+v known %v", size, offset+1, rec.Usage, rec.UsageKnown)
			}
			if held && !strings.Contains(events, usageKey) {
				t.Fatalf("reads of %d: a tail buffer held before the stream mentioned its usage", size)
			}
		}
	}
}
