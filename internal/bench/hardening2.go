package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/baton-llm/baton/internal/kvevents"
	"github.com/baton-llm/baton/internal/sim"
)

// The attacks of the second hardening pass: bodies held open past the process budget, KV event
// frames that claim memory, a flood of KV blocks on a spoofed topic and from the worker's own
// address, and request heads of short lines. Each names a setting older builds also accept, so
// that --binary can run them against one.

// heldBodies opens n connections that each send a body of size bytes but its last, holds them,
// and counts the answers that refused the body (503) before it ended.
func heldBodies(ctx context.Context, b *proc, n, size int) string {
	addr := strings.TrimPrefix(b.URL, "http://")
	head := "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " + strconv.Itoa(size) + "\r\n\r\n"
	chunk := bytes.Repeat([]byte(" "), 1<<20)
	copy(chunk, `{"model":"`+benchModel+`","pad":"`)
	conns := make([]net.Conn, n)
	var wg sync.WaitGroup
	for i := range conns {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			return err.Error()
		}
		conns[i] = c
		wg.Go(func() {
			if _, err := io.WriteString(c, head); err != nil {
				return
			}
			for left := size - 1; left > 0 && ctx.Err() == nil; {
				k, err := c.Write(chunk[:min(len(chunk), left)])
				if err != nil {
					return // refused: Baton closed the connection
				}
				left -= k
			}
		})
	}
	wg.Wait()
	time.Sleep(time.Second) // held, last byte missing
	refused := 0
	for _, c := range conns {
		_ = c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
		if line, _ := bufio.NewReader(c).ReadString('\n'); strings.Contains(line, " 503 ") {
			refused++
		}
		c.Close()
	}
	return fmt.Sprintf("%d of %d refused 503 while arriving", refused, n)
}

// longHeads opens n connections that each send a request head of size bytes of short header
// lines without its end, holds them, and counts the connections Baton answered or closed.
func longHeads(ctx context.Context, b *proc, n, size int) string {
	addr := strings.TrimPrefix(b.URL, "http://")
	head := []byte("GET /v1/models HTTP/1.1\r\nHost: x\r\n")
	for len(head) < size {
		head = append(head, "a: b\r\n"...)
	}
	conns := make([]net.Conn, 0, n)
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			break // past a connection cap, or out of descriptors
		}
		conns = append(conns, c)
		wg.Go(func() { _, _ = c.Write(head) })
	}
	wg.Wait()
	time.Sleep(time.Second)
	ended := 0
	for _, c := range conns {
		_ = c.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
		if _, err := c.Read(make([]byte, 1)); err == nil || err == io.EOF {
			ended++ // a 431 (or the connection closed)
		}
		c.Close()
	}
	return fmt.Sprintf("%d of %d connections answered or closed", ended, n)
}

// kvListenFleet is one simulated vLLM engine (its URL stored in *url) and a Baton listening for
// KV events on a free port, whose address it stores in *listen.
func kvListenFleet(listen, url *string) func() ([]string, func(), error) {
	return func() ([]string, func(), error) {
		e, err := engine(sim.Config{Engine: sim.EngineVLLM})
		if err != nil {
			return nil, nil, err
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			e.Close()
			return nil, nil, err
		}
		*listen, *url = ln.Addr().String(), e.URL()
		ln.Close()
		return []string{"--worker-urls", e.URL(), "--policy", "cache_aware", "--kv-events-listen", "tcp://" + *listen}, e.Close, nil
	}
}

// zmtpPub connects to a KV events listener at addr (from 127.0.0.2 when spoofed) and greets as
// a ZMQ PUB: a ZMTP 3.0 NULL greeting and a READY command. What Baton sends back is drained;
// closed is closed when Baton closes the connection.
func zmtpPub(addr string, spoofed bool) (c net.Conn, closed chan struct{}, err error) {
	d := net.Dialer{Timeout: 5 * time.Second}
	if spoofed {
		d.LocalAddr = &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2)}
	}
	c, err = d.Dial("tcp", addr)
	if err != nil {
		return nil, nil, err
	}
	if _, err := c.Write(kvevents.PubHello()); err != nil {
		c.Close()
		return nil, nil, err
	}
	closed = make(chan struct{})
	go func() { _, _ = io.Copy(io.Discard, c); close(closed) }()
	return c, closed, nil
}

// zmtpFrames appends one ZMTP message of frames to out.
func zmtpFrames(out []byte, frames ...[]byte) []byte {
	for i, f := range frames {
		flags := byte(0)
		if i < len(frames)-1 {
			flags |= 0x01
		}
		if len(f) > 255 {
			out = append(out, flags|0x02)
			out = binary.BigEndian.AppendUint64(out, uint64(len(f)))
		} else {
			out = append(out, flags, byte(len(f)))
		}
		out = append(out, f...)
	}
	return out
}

// zmtpClaims opens n connections to a KV events listener at addr that each greet as a ZMQ PUB
// and send one frame header claiming claim bytes, then nothing; holds them a while. The Go heap
// Baton reports while they are held goes with the outcome: the claims are allocated but never
// written, so resident memory hides them.
func zmtpClaims(b *proc, addr string, n int, claim uint64) string {
	var conns []net.Conn
	var ends []chan struct{}
	for i := 0; i < n; i++ {
		c, closed, err := zmtpPub(addr, false)
		if err != nil {
			return err.Error()
		}
		conns, ends = append(conns, c), append(ends, closed)
		_, _ = c.Write(binary.BigEndian.AppendUint64([]byte{0x02}, claim))
	}
	time.Sleep(2 * time.Second)
	heap := b.metric("go_memstats_heap_alloc_bytes")
	closed := 0
	for i, c := range conns {
		select {
		case <-ends[i]:
			closed++
		default:
		}
		c.Close()
	}
	return fmt.Sprintf("%d of %d connections closed by Baton; Go heap %.0f MiB while held", closed, n, heap/(1<<20))
}

// floodBlocks publishes blocks distinct KV blocks (16 tokens each, 256 per message) to the
// listener at addr on the topic naming the engine at engineURL, from 127.0.0.2 when spoofed,
// over TCP (nothing dropped on the way); it reports what Baton's index then holds.
func floodBlocks(ctx context.Context, b *proc, addr, engineURL string, blocks int, spoofed bool) string {
	c, _, err := zmtpPub(addr, spoofed)
	if err != nil {
		return err.Error()
	}
	defer c.Close()
	topic := []byte("kv@" + strings.TrimPrefix(engineURL, "http://") + "@" + benchModel)
	const perMsg, bs = 256, 16
	hashes := make([]uint64, perMsg)
	tokens := make([]uint32, perMsg*bs)
	var buf bytes.Buffer
	var out []byte
	for m := 0; m*perMsg < blocks && ctx.Err() == nil; m++ {
		for i := range hashes {
			hashes[i] = uint64(m*perMsg + i + 1)
		}
		for i := range tokens {
			tokens[i] = uint32(m*len(tokens) + i)
		}
		buf.Reset()
		enc := msgpack.NewEncoder(&buf)
		enc.UseCompactInts(true)
		if err := enc.Encode([]any{float64(time.Now().UnixNano()) / 1e9, []any{[]any{"BlockStored", hashes, nil, tokens, bs, nil, "GPU"}}}); err != nil {
			return err.Error()
		}
		out = zmtpFrames(out[:0], topic, binary.BigEndian.AppendUint64(nil, uint64(m)), buf.Bytes())
		if _, err := c.Write(out); err != nil {
			return "the publisher's connection was closed: " + shortErr(err)
		}
	}
	// Let Baton apply what arrived: until the index stops growing.
	last := -1.0
	for i := 0; i < 60; i++ {
		time.Sleep(500 * time.Millisecond)
		n := b.metric("baton_kv_index_blocks")
		if n == last {
			break
		}
		last = n
	}
	return fmt.Sprintf("index holds %.2f M blocks", last/1e6)
}

// hardening2Attacks are the attacks of the second hardening pass.
func hardening2Attacks(quick bool) []attack {
	scale, blocks := 1, 4_200_000
	if quick {
		scale, blocks = 16, 65_536
	}
	var listen, engineURL string
	return []attack{
		{name: fmt.Sprintf("six %d MB bodies held open, last byte missing (`--max-concurrent-requests 2`, `--max-payload-size` 128 MiB)", 100/scale),
			fleet: func() ([]string, func(), error) {
				args, cleanup, err := regularFleet()
				return append(args, "--max-concurrent-requests", "2", "--max-payload-size", strconv.Itoa(128<<20)), cleanup, err
			},
			run: func(ctx context.Context, c *http.Client, b *proc) string {
				return heldBodies(ctx, b, 6, 100_000_000/scale)
			}},
		{name: "32 KV event peers each claiming a 64 MiB frame (9 bytes sent)", fleet: kvListenFleet(&listen, &engineURL),
			run: func(ctx context.Context, c *http.Client, b *proc) string { return zmtpClaims(b, listen, 32, 64<<20) }},
		{name: fmt.Sprintf("%.2f M KV blocks on a topic naming the engine, from another address", float64(blocks)/1e6), fleet: kvListenFleet(&listen, &engineURL),
			run: func(ctx context.Context, c *http.Client, b *proc) string {
				return floodBlocks(ctx, b, listen, engineURL, blocks, true)
			}},
		{name: fmt.Sprintf("%.2f M KV blocks from the engine's own address, `GOMEMLIMIT=920MiB` (the chart's)", float64(blocks)/1e6), fleet: kvListenFleet(&listen, &engineURL),
			env: []string{"GOMEMLIMIT=920MiB"},
			run: func(ctx context.Context, c *http.Client, b *proc) string {
				return floodBlocks(ctx, b, listen, engineURL, blocks, false)
			}},
		{name: fmt.Sprintf("100 sockets each sending a %d KiB request head of short lines", 1024/scale), fleet: regularFleet,
			run: func(ctx context.Context, c *http.Client, b *proc) string {
				return longHeads(ctx, b, 100, (1<<20)/scale)
			}},
	}
}
