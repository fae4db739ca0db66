//! Admin output: rows of typed cells rendered as an aligned table or as a
//! JSON array of objects keyed by column name.

use serde_json::{Map, Value};

use crate::log::{rfc3339_millis, rfc3339_seconds};

/// What a table cell holds. The store sends every cell as text (`NULL` for
/// SQL NULL); [`Cell::typed`] restores the schema's types by column name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cell {
    Null,
    Text(String),
    Int(i64),
    /// A count that may exceed `i64` (an IPv6 block's size).
    Count(u128),
    Bool(bool),
    /// Unix milliseconds.
    Time(i64),
}

/// Integer columns of `cidr_blocks` and `ip_addresses`.
const INT_COLUMNS: &[&str] = &["id", "total_ips", "allocated_ips", "cidr_block_id"];
/// Unix-millisecond columns, shown as RFC 3339 UTC.
const TIME_COLUMNS: &[&str] = &["created_at", "updated_at", "release_at", "allocated_at"];
/// Boolean columns (stored as 0/1).
const BOOL_COLUMNS: &[&str] = &["is_allocated"];

impl Cell {
    /// Types the text the store sent for `column`. A value that does not
    /// parse as its column's type (a foreign database) stays text.
    pub fn typed(column: &str, text: &str) -> Cell {
        if text == "NULL" {
            return Cell::Null;
        }
        let as_int = || text.parse::<i64>().ok();
        let typed = if INT_COLUMNS.contains(&column) {
            as_int().map(Cell::Int)
        } else if TIME_COLUMNS.contains(&column) {
            as_int().map(Cell::Time)
        } else if BOOL_COLUMNS.contains(&column) {
            match text {
                "1" | "true" => Some(Cell::Bool(true)),
                "0" | "false" => Some(Cell::Bool(false)),
                _ => None,
            }
        } else {
            None
        };
        typed.unwrap_or_else(|| Cell::Text(text.to_string()))
    }

    /// Table text: times as RFC 3339 UTC to the second, NULL as `NULL`.
    fn text(&self) -> String {
        match self {
            Cell::Null => "NULL".to_string(),
            Cell::Text(text) => text.clone(),
            Cell::Int(n) => n.to_string(),
            Cell::Count(n) => n.to_string(),
            Cell::Bool(b) => b.to_string(),
            Cell::Time(ms) => rfc3339_seconds(*ms).to_string(),
        }
    }

    /// JSON value: times as RFC 3339 UTC strings with milliseconds (the
    /// stored precision), NULL as `null`.
    fn json(&self) -> Value {
        match self {
            Cell::Null => Value::Null,
            Cell::Text(text) => Value::from(text.as_str()),
            Cell::Int(n) => Value::from(*n),
            // JSON numbers past 2^63 lose precision in most parsers: a
            // larger count is its exact decimal text.
            Cell::Count(n) => {
                i64::try_from(*n).map_or_else(|_| Value::from(n.to_string()), Value::from)
            }
            Cell::Bool(b) => Value::from(*b),
            Cell::Time(ms) => Value::from(rfc3339_millis(*ms).to_string()),
        }
    }
}

/// A result set: column names, then rows of as many cells.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Rows {
    pub columns: Vec<String>,
    pub rows: Vec<Vec<Cell>>,
}

impl Rows {
    /// Types a table as the store sends it (headers, rows of text).
    pub fn from_text(headers: Vec<String>, rows: Vec<Vec<String>>) -> Rows {
        let rows = rows
            .into_iter()
            .map(|row| {
                headers
                    .iter()
                    .zip(row.iter())
                    .map(|(column, text)| Cell::typed(column, text))
                    .collect()
            })
            .collect();
        Rows {
            columns: headers,
            rows,
        }
    }

    /// Upper-cased headers, then one line per row; columns left-aligned and
    /// two spaces apart, no trailing spaces.
    pub fn table(&self) -> String {
        let header: Vec<String> = self.columns.iter().map(|c| c.to_uppercase()).collect();
        let body: Vec<Vec<String>> = self
            .rows
            .iter()
            .map(|row| row.iter().map(Cell::text).collect())
            .collect();
        let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
        for row in &body {
            for (width, text) in widths.iter_mut().zip(row) {
                *width = (*width).max(text.chars().count());
            }
        }
        let mut out = String::new();
        for line in std::iter::once(&header).chain(body.iter()) {
            let mut text = String::new();
            for (cell, width) in line.iter().zip(&widths) {
                text.push_str(&format!("{cell:<width$}  "));
            }
            out.push_str(text.trim_end());
            out.push('\n');
        }
        out
    }

    /// A JSON array (two-space indented) of one object per row, keys in
    /// column order; `[]` when there are no rows.
    pub fn json(&self) -> String {
        let objects: Vec<Value> = self
            .rows
            .iter()
            .map(|row| {
                let object: Map<String, Value> = self
                    .columns
                    .iter()
                    .zip(row)
                    .map(|(column, cell)| (column.clone(), cell.json()))
                    .collect();
                Value::Object(object)
            })
            .collect();
        let mut text = serde_json::to_string_pretty(&objects).unwrap_or_else(|_| "[]".to_string());
        text.push('\n');
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Rows {
        Rows::from_text(
            vec![
                "id".into(),
                "container_id".into(),
                "is_allocated".into(),
                "release_at".into(),
                "pod_name".into(),
            ],
            vec![
                vec![
                    "1".into(),
                    "c-long-name".into(),
                    "1".into(),
                    "NULL".into(),
                    "NULL".into(),
                ],
                vec![
                    "12".into(),
                    "".into(),
                    "0".into(),
                    "1795971684123".into(),
                    "p".into(),
                ],
            ],
        )
    }

    #[test]
    fn cells_get_their_columns_types() {
        assert_eq!(Cell::typed("id", "7"), Cell::Int(7));
        assert_eq!(Cell::typed("id", "x"), Cell::Text("x".into()));
        assert_eq!(Cell::typed("is_allocated", "0"), Cell::Bool(false));
        assert_eq!(Cell::typed("updated_at", "5"), Cell::Time(5));
        assert_eq!(Cell::typed("network", "NULL"), Cell::Null);
        assert_eq!(Cell::typed("network", "7"), Cell::Text("7".into()));
    }

    #[test]
    fn table_is_aligned_with_upper_case_headers() {
        assert_eq!(
            sample().table(),
            "ID  CONTAINER_ID  IS_ALLOCATED  RELEASE_AT            POD_NAME\n\
             1   c-long-name   true          NULL                  NULL\n\
             12                false         2026-11-29T17:01:24Z  p\n"
        );
    }

    #[test]
    fn json_keeps_column_names_and_natural_types() {
        let value: Value = serde_json::from_str(&sample().json()).unwrap();
        assert_eq!(
            value,
            serde_json::json!([
                {"id": 1, "container_id": "c-long-name", "is_allocated": true,
                 "release_at": null, "pod_name": null},
                {"id": 12, "container_id": "", "is_allocated": false,
                 "release_at": "2026-11-29T17:01:24.123Z", "pod_name": "p"}
            ])
        );
        assert_eq!(Rows::default().json(), "[]\n");
    }
}
