package openai

import "encoding/binary"

// maxDepth bounds nesting, as encoding/json does.
const maxDepth = 10000

// Valid reports whether b is one valid JSON value, with the same verdict as json.Valid. It is
// written for the request path: strings (most of a prompt's bytes) are scanned eight bytes at a
// time, and it does not allocate.
func Valid(b []byte) bool {
	i, ok := validValue(b, skipWS(b, 0), 0, false)
	return ok && skipWS(b, i) == len(b)
}

// ValidPython reports whether b is one value as Python's json.loads reads it: JSON, and the
// constants NaN, Infinity and -Infinity wherever a value may stand. (It does not check UTF-8,
// which Python decodes before it parses.)
func ValidPython(b []byte) bool {
	i, ok := validValue(b, skipWS(b, 0), 0, true)
	return ok && skipWS(b, i) == len(b)
}

// validValue checks the value at b[i]; py admits Python's constants.
func validValue(b []byte, i, depth int, py bool) (int, bool) {
	if i >= len(b) {
		return i, false
	}
	switch c := b[i]; {
	case c == '"':
		return validString(b, i)
	case c == '{':
		return validObject(b, i, depth+1, py)
	case c == '[':
		return validArray(b, i, depth+1, py)
	case c == 't':
		return literal(b, i, "true")
	case c == 'f':
		return literal(b, i, "false")
	case c == 'n':
		return literal(b, i, "null")
	case py && c == 'N':
		return literal(b, i, "NaN")
	case py && c == 'I':
		return literal(b, i, "Infinity")
	case py && c == '-' && i+1 < len(b) && b[i+1] == 'I':
		return literal(b, i, "-Infinity")
	case c == '-' || (c >= '0' && c <= '9'):
		return validNumber(b, i)
	}
	return i, false
}

func literal(b []byte, i int, lit string) (int, bool) {
	if len(b)-i < len(lit) || string(b[i:i+len(lit)]) != lit {
		return i, false
	}
	return i + len(lit), true
}

func validObject(b []byte, i, depth int, py bool) (int, bool) {
	if depth > maxDepth {
		return i, false
	}
	i = skipWS(b, i+1)
	if i < len(b) && b[i] == '}' {
		return i + 1, true
	}
	for {
		if i >= len(b) || b[i] != '"' {
			return i, false
		}
		var ok bool
		if i, ok = validString(b, i); !ok {
			return i, false
		}
		i = skipWS(b, i)
		if i >= len(b) || b[i] != ':' {
			return i, false
		}
		if i, ok = validValue(b, skipWS(b, i+1), depth, py); !ok {
			return i, false
		}
		i = skipWS(b, i)
		if i >= len(b) {
			return i, false
		}
		switch b[i] {
		case ',':
			i = skipWS(b, i+1)
		case '}':
			return i + 1, true
		default:
			return i, false
		}
	}
}

func validArray(b []byte, i, depth int, py bool) (int, bool) {
	if depth > maxDepth {
		return i, false
	}
	i = skipWS(b, i+1)
	if i < len(b) && b[i] == ']' {
		return i + 1, true
	}
	for {
		var ok bool
		if i, ok = validValue(b, i, depth, py); !ok {
			return i, false
		}
		i = skipWS(b, i)
		if i >= len(b) {
			return i, false
		}
		switch b[i] {
		case ',':
			i = skipWS(b, i+1)
		case ']':
			return i + 1, true
		default:
			return i, false
		}
	}
}

const (
	lsb = 0x0101010101010101
	msb = 0x8080808080808080
)

// special reports, per byte of the little-endian word x, whether the byte is a control
// character, '"' or '\\': the bytes a string scan must stop at.
func special(x uint64) uint64 {
	ctl := (x - lsb*0x20) &^ x
	q := x ^ (lsb * '"')
	bs := x ^ (lsb * '\\')
	return (ctl | ((q - lsb) &^ q) | ((bs - lsb) &^ bs)) & msb
}

// validString checks the string starting at b[i] == '"' and returns the index past it.
func validString(b []byte, i int) (int, bool) {
	i++
	for {
		for i+8 <= len(b) && special(binary.LittleEndian.Uint64(b[i:])) == 0 {
			i += 8
		}
		if i >= len(b) {
			return i, false
		}
		switch c := b[i]; {
		case c == '"':
			return i + 1, true
		case c == '\\':
			if i+1 >= len(b) {
				return i, false
			}
			switch b[i+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				i += 2
			case 'u':
				if i+6 > len(b) {
					return i, false
				}
				for _, h := range b[i+2 : i+6] {
					if !isHex(h) {
						return i, false
					}
				}
				i += 6
			default:
				return i, false
			}
		case c < 0x20:
			return i, false
		default:
			i++ // a byte the word scan stopped near but that is ordinary
		}
	}
}

func isHex(c byte) bool { return c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F' }

func isDigit(c byte) bool { return c >= '0' && c <= '9' }

func validNumber(b []byte, i int) (int, bool) {
	if b[i] == '-' {
		i++
	}
	switch {
	case i < len(b) && b[i] == '0':
		i++
	case i < len(b) && isDigit(b[i]):
		for i < len(b) && isDigit(b[i]) {
			i++
		}
	default:
		return i, false
	}
	if i < len(b) && b[i] == '.' {
		i++
		if i >= len(b) || !isDigit(b[i]) {
			return i, false
		}
		for i < len(b) && isDigit(b[i]) {
			i++
		}
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		if i >= len(b) || !isDigit(b[i]) {
			return i, false
		}
		for i < len(b) && isDigit(b[i]) {
			i++
		}
	}
	return i, true
}
