package bench

import (
	"fmt"
	"strings"
	"testing"
)

// A process's log keeps its latest line per request id, however the writes split the lines,
// and forgets the oldest ids past its bound.
func TestProcLogKeepsTheLatestLinePerRequestID(t *testing.T) {
	var l procLog
	text := "time=1 level=INFO msg=request status=200 request_id=r1 duration_ms=3\n" +
		"time=2 level=WARN msg=\"engine down\" worker=w\n" +
		"time=3 level=INFO msg=request status=502 request_id=r2\n" +
		"time=4 level=INFO msg=request status=504 request_id=r1 aborted=true\n"
	for i := 0; i < len(text); i += 7 { // lines arrive in pieces
		l.Write([]byte(text[i:min(i+7, len(text))]))
	}
	if line, ok := l.lineOf("r1"); !ok || !strings.Contains(line, "status=504") {
		t.Errorf("r1: %q %v", line, ok)
	}
	if line, ok := l.lineOf("r2"); !ok || !strings.HasSuffix(line, "request_id=r2") {
		t.Errorf("r2: %q %v", line, ok)
	}
	if _, ok := l.lineOf("w"); ok {
		t.Error("a line without a request id was kept by id")
	}
	for i := range procLogIDs + 10 {
		fmt.Fprintf(&l, "level=INFO request_id=x%d\n", i)
	}
	if _, ok := l.lineOf("x0"); ok {
		t.Error("the oldest id was kept past the bound")
	}
	if _, ok := l.lineOf(fmt.Sprintf("x%d", procLogIDs+9)); !ok {
		t.Error("the latest id was forgotten")
	}
	if len(l.byID) > procLogIDs {
		t.Errorf("%d ids held, bound %d", len(l.byID), procLogIDs)
	}
}
